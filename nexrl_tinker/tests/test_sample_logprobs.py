"""Top-k and target logprobs on sampling, through the real SDK, checked against the
model's own log-softmax computed here with torch on the same weights.

Each logprob the service returns is of the raw model distribution (temperature 1, no
filters), the distribution of ``prompt_logprobs``: the requests below sample at other
temperatures and with top-k/top-p filters to show that those change nothing here.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from nexrl_service.sampling import MAX_TOPK_LOGPROBS
from nexrl_tinker.testing import BASE_MODEL, TEST_API_KEY

TOLERANCE = 1e-4
K = 5


@pytest.fixture(scope="module")
def sampler(service_client):
    return service_client.create_sampling_client(base_model=BASE_MODEL).result(timeout=60)


@pytest.fixture(scope="module")
def tokens() -> list[int]:
    """A chat prompt and its answer, as the teacher-forced sequences distillation sends."""
    from nexrl_engine.loading import load_tokenizer, resolve_model_dir

    tokenizer = load_tokenizer(resolve_model_dir(BASE_MODEL))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "12+34="}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return prompt + tokenizer.encode("46<|im_end|>", add_special_tokens=False)


@pytest.fixture(scope="module")
def log_softmax() -> Callable[[list[int]], torch.Tensor]:
    """Row j: log p(· | tokens[: j + 1]) under the tiny model, loaded here from its files."""
    from transformers import AutoModelForCausalLM

    from nexrl_engine.loading import resolve_model_dir

    model = AutoModelForCausalLM.from_pretrained(str(resolve_model_dir(BASE_MODEL)), torch_dtype=torch.float32).eval()

    def of(sequence: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([sequence])).logits[0].float(), dim=-1)

    return of


def test_topk_prompt_logprobs_are_the_models_top_k_at_every_position(sampler, tokens, log_softmax) -> None:
    params = types.SamplingParams(max_tokens=1, temperature=0.7, top_k=3, top_p=0.9, seed=4)
    response = sampler.sample(types.ModelInput.from_ints(tokens), 1, params, include_prompt_logprobs=True, topk_prompt_logprobs=K).result(
        timeout=60
    )
    topk, plain = response.topk_prompt_logprobs, response.prompt_logprobs
    assert topk is not None and plain is not None
    assert len(topk) == len(plain) == len(tokens)
    assert topk[0] is None, "position 0 has no context"
    reference = log_softmax(tokens)
    for position in range(1, len(tokens)):
        row = topk[position]
        assert row is not None and len(row) == K
        ids, values = [token for token, _ in row], [value for _, value in row]
        expected = reference[position - 1].topk(K)
        assert ids == expected.indices.tolist(), position
        np.testing.assert_allclose(values, expected.values.tolist(), atol=TOLERANCE)
        assert values == sorted(values, reverse=True)
        assert ids[0] == int(reference[position - 1].argmax())
        realised = plain[position]
        assert realised == pytest.approx(float(reference[position - 1, tokens[position]]), abs=TOLERANCE)
        assert realised <= values[0] + 1e-6
        if tokens[position] in ids:
            assert realised == pytest.approx(values[ids.index(tokens[position])], abs=1e-6)
        else:
            assert realised <= values[-1] + 1e-6


def test_prompt_logprobs_last_n_cuts_the_topk_rows_too(sampler, tokens) -> None:
    prompt = types.ModelInput.from_ints(tokens)
    params = types.SamplingParams(max_tokens=1)
    whole = sampler.sample(prompt, 1, params, include_prompt_logprobs=True, topk_prompt_logprobs=2).result(timeout=60)
    last = sampler.sample(prompt, 1, params, include_prompt_logprobs=True, topk_prompt_logprobs=2, prompt_logprobs_last_n=3).result(
        timeout=60
    )
    assert last.topk_prompt_logprobs is not None and whole.topk_prompt_logprobs is not None
    assert last.topk_prompt_logprobs[:-3] == [None] * (len(tokens) - 3)
    for got, full in zip(last.topk_prompt_logprobs[-3:], whole.topk_prompt_logprobs[-3:]):
        assert [t for t, _ in got] == [t for t, _ in full]
        np.testing.assert_allclose([v for _, v in got], [v for _, v in full], atol=1e-5)


def test_topk_sample_logprobs_are_the_models_top_k_at_every_sampled_token(sampler, tokens, log_softmax) -> None:
    prompt = tokens[:-3]
    params = types.SamplingParams(max_tokens=6, temperature=1.3, seed=11, stop=[])
    response = sampler.sample(types.ModelInput.from_ints(prompt), 2, params, topk_sample_logprobs=3).result(timeout=60)
    assert response.topk_prompt_logprobs is None and response.prompt_logprobs is None
    for sequence in response.sequences:
        assert sequence.topk_logprobs is not None and len(sequence.topk_logprobs) == len(sequence.tokens) == 6
        reference = log_softmax(prompt + sequence.tokens)
        for step, (token, logprob, row) in enumerate(zip(sequence.tokens, sequence.logprobs, sequence.topk_logprobs)):
            assert row is not None
            expected = reference[len(prompt) - 1 + step].topk(3)
            assert [t for t, _ in row] == expected.indices.tolist()
            np.testing.assert_allclose([v for _, v in row], expected.values.tolist(), atol=TOLERANCE)
            assert logprob <= row[0][1] + 1e-6
            assert logprob == pytest.approx(float(reference[len(prompt) - 1 + step, token]), abs=TOLERANCE)


@pytest.mark.parametrize("layout", ["dense", "sparse"])
def test_target_prompt_logprobs_score_the_named_ids_in_the_requests_layout(sampler, tokens, log_softmax, layout) -> None:
    rows = len(tokens) - 1
    ids = torch.full((rows, 3), -1, dtype=torch.int64)
    ids[rows - 1] = torch.tensor([tokens[-1], 0, 7])  # row i scores prompt position i + 1
    ids[2, 1] = 19
    if layout == "dense":
        ids[:, 0] = torch.tensor(tokens[1:])
        target = types.TensorData.from_torch(ids)
    else:
        target = types.TensorData.from_torch_sparse(ids, pad_value=-1)
        assert target.sparse_crow_indices is not None, "the SDK chose CSR"
    response = sampler.sample(
        types.ModelInput.from_ints(tokens), 1, types.SamplingParams(max_tokens=1, temperature=0.0), target_prompt_logprobs=target
    ).result(timeout=60)
    answer = response.target_prompt_logprobs
    assert answer is not None and answer.dtype == "float32" and answer.shape == [rows, 3]
    assert answer.sparse_crow_indices == target.sparse_crow_indices
    assert answer.sparse_col_indices == target.sparse_col_indices
    got = answer.to_torch()
    reference = log_softmax(tokens)
    for row in range(rows):
        for column in range(3):
            token = int(ids[row, column])
            expected = 0.0 if token < 0 else float(reference[row, token])
            assert float(got[row, column]) == pytest.approx(expected, abs=TOLERANCE), (row, column)


def test_target_prompt_logprobs_agree_with_topk_and_prompt_logprobs(sampler, tokens) -> None:
    """All three kinds come from one prefill: the same numbers where they overlap."""
    rows = len(tokens) - 1
    first = sampler.sample(
        types.ModelInput.from_ints(tokens), 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True, topk_prompt_logprobs=2
    ).result(timeout=60)
    assert first.topk_prompt_logprobs is not None and first.prompt_logprobs is not None
    ids = torch.tensor([[row[0][0], row[1][0], tokens[p]] for p, row in enumerate(first.topk_prompt_logprobs) if row is not None])
    second = sampler.sample(
        types.ModelInput.from_ints(tokens), 1, types.SamplingParams(max_tokens=1), target_prompt_logprobs=types.TensorData.from_torch(ids)
    ).result(timeout=60)
    assert second.target_prompt_logprobs is not None and ids.shape == (rows, 3)
    got = second.target_prompt_logprobs.to_torch()
    for row, position in enumerate(range(1, len(tokens))):
        top = first.topk_prompt_logprobs[position]
        assert top is not None
        np.testing.assert_allclose(got[row].tolist(), [top[0][1], top[1][1], first.prompt_logprobs[position]], atol=1e-5)


def _asample(base_url: str, tokens: list[int], **fields) -> httpx.Response:
    """A raw ``asample`` of the base model (the SDK checks some of these fields itself)."""
    body = {
        "base_model": BASE_MODEL,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
        "sampling_params": {"max_tokens": 1},
        **fields,
    }
    return httpx.post(f"{base_url}/api/v1/asample", json=body, headers={"X-API-Key": TEST_API_KEY}, timeout=60)


def test_bad_widths_and_targets_are_refused_saying_what_to_change(base_url, sampler, tokens) -> None:
    prompt = types.ModelInput.from_ints(tokens)
    params = types.SamplingParams(max_tokens=1)
    with pytest.raises(tinker.BadRequestError, match=f"topk_prompt_logprobs must be from 0 to {MAX_TOPK_LOGPROBS}"):
        sampler.sample(prompt, 1, params, topk_prompt_logprobs=MAX_TOPK_LOGPROBS + 1).result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match="topk_sample_logprobs must be from 0 to"):
        sampler.sample(prompt, 1, params, topk_sample_logprobs=-1).result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match="lower k, num_samples or max_tokens"):
        sampler.sample(prompt, 1024, types.SamplingParams(max_tokens=1000), topk_sample_logprobs=MAX_TOPK_LOGPROBS).result(timeout=60)
    rows = len(tokens) - 1
    with pytest.raises(tinker.BadRequestError, match=rf"needs \[len\(prompt\) - 1, K\] = \[{rows}, K\]"):
        sampler.sample(
            prompt, 1, params, target_prompt_logprobs=types.TensorData.from_torch(torch.zeros((rows + 1, 2), dtype=torch.int64))
        ).result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match="names no token id"):
        sampler.sample(prompt, 1, params, target_prompt_logprobs=types.TensorData.from_torch(torch.full((rows, 2), -1))).result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match=r"neither -1 \(no id\) nor in the vocabulary"):
        sampler.sample(prompt, 1, params, target_prompt_logprobs=types.TensorData.from_torch(torch.full((rows, 1), 10**6))).result(
            timeout=60
        )
    response = _asample(base_url, tokens, target_prompt_logprobs={"data": [1.5] * rows, "dtype": "float32", "shape": [rows, 1]})
    assert response.status_code == 400 and "int64 token ids" in response.json()["detail"]
    response = _asample(base_url, tokens, prompt_alt_tokens_k=2)
    assert response.status_code == 400 and "prompt_alt_tokens_k is not supported" in response.json()["detail"]
