"""The whole tinker SDK surface a training script uses, against a real TinkerCloud."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from nexrl_engine.loading import SHIPPED_HUB_NAMES
from nexrl_tinker.testing import BASE_MODEL

SERVED_NAME = SHIPPED_HUB_NAMES[BASE_MODEL].model_name
"""What the service calls the tiny model (requests may still say ``nexrl-tiny``)."""


@pytest.fixture(scope="module")
def training_client(service_client):
    return service_client.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=3).result(timeout=120)


@pytest.fixture(scope="module")
def tokenizer(training_client):
    return training_client.get_tokenizer()


def chat_prompt(tokenizer, question: str) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def sft_datum(tokenizer, question: str, answer: str) -> types.Datum:
    prompt = chat_prompt(tokenizer, question)
    completion = tokenizer.encode(answer + "<|im_end|>", add_special_tokens=False)
    tokens = prompt + completion
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def rl_datum(datum: types.Datum, logprobs: list[float], advantage: float) -> types.Datum:
    targets = datum.loss_fn_inputs["target_tokens"].tolist()
    return types.Datum(
        model_input=datum.model_input,
        loss_fn_inputs={
            "target_tokens": targets,
            "logprobs": logprobs,
            "advantages": [advantage] * len(targets),
        },
    )


def test_get_info_and_tokenizer(training_client, tokenizer):
    info = training_client.get_info()
    assert info.model_data.model_name == SERVED_NAME
    assert info.is_lora is True and info.lora_rank == 8
    assert training_client.model_id.endswith(":train:0")
    ids = tokenizer.encode("12+34=")
    assert tokenizer.decode(ids) == "12+34="


def test_full_sdk_flow(base_url, service_client, training_client, tokenizer):
    data = [sft_datum(tokenizer, "12+34=", "46"), sft_datum(tokenizer, "7+8=", "15")]

    # forward_backward + optim_step, pipelined as the SDK recommends.
    fb = training_client.forward_backward(data, "cross_entropy")
    opt = training_client.optim_step(types.AdamParams(learning_rate=1e-3))
    fb_out, opt_out = fb.result(timeout=120), opt.result(timeout=120)
    assert set(fb_out.metrics) >= {"loss:sum", "num_tokens:sum"}
    assert all(key.count(":") == 1 for key in fb_out.metrics)
    assert len(fb_out.loss_fn_outputs) == 2
    for datum, output in zip(data, fb_out.loss_fn_outputs):
        logprobs = output["logprobs"]
        assert logprobs.shape == [datum.model_input.length]
        assert all(v <= 0 for v in logprobs.tolist())
    weights = [d.loss_fn_inputs["weights"].tolist() for d in data]
    expected = -sum(w * lp for ws, o in zip(weights, fb_out.loss_fn_outputs) for w, lp in zip(ws, o["logprobs"].tolist()))
    assert fb_out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4)
    assert opt_out.metrics is not None and all(key.count(":") == 1 for key in opt_out.metrics)

    # RL losses, with the forward pass's logprobs as the sampler's.
    current = training_client.forward(data, "cross_entropy").result(timeout=120)
    old = [o["logprobs"].tolist() for o in current.loss_fn_outputs]
    rl = [rl_datum(d, lp, adv) for d, lp, adv in zip(data, old, (1.0, -0.5))]
    is_out = training_client.forward_backward(rl, "importance_sampling").result(timeout=120)
    # On-policy ratios are 1, so the importance-sampling loss is -sum(advantages).
    n0, n1 = (d.model_input.length for d in data)
    assert is_out.metrics["loss:sum"] == pytest.approx(-(1.0 * n0 - 0.5 * n1), rel=1e-3)
    ppo_out = training_client.forward_backward(rl, "ppo", loss_fn_config={"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}).result(
        timeout=120
    )
    assert ppo_out.metrics["loss:sum"] == pytest.approx(is_out.metrics["loss:sum"], rel=1e-3)
    training_client.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=120)

    after = training_client.forward(data, "cross_entropy").result(timeout=120)
    assert after.metrics["loss:sum"] != pytest.approx(current.metrics["loss:sum"])

    # Checkpoints.
    state = training_client.save_state("flow-state").result(timeout=120)
    assert state.path == f"tinker://{training_client.model_id}/weights/flow-state"
    sampler_path = training_client.save_weights_for_sampler("flow-sampler").result(timeout=120).path
    assert sampler_path == f"tinker://{training_client.model_id}/sampler_weights/flow-sampler"

    # Sampling from the named sampler weights.
    sampling_client = service_client.create_sampling_client(model_path=sampler_path).result(timeout=60)
    assert sampling_client.get_base_model() == SERVED_NAME
    prompt = types.ModelInput.from_ints(chat_prompt(tokenizer, "21+30="))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    response = sampling_client.sample(
        prompt, num_samples=3, sampling_params=types.SamplingParams(max_tokens=12, temperature=1.0, seed=11, stop=[im_end])
    ).result(timeout=120)
    assert len(response.sequences) == 3
    assert len({s.sequence_id for s in response.sequences}) == 3
    for seq in response.sequences:
        assert seq.logprobs is not None and len(seq.logprobs) == len(seq.tokens) >= 1
        assert seq.stop_reason in ("stop", "length")
        if seq.stop_reason == "stop":
            assert seq.tokens[-1] == im_end
    # String stops: the text stops right after the stop string.
    string_stop = sampling_client.sample(
        prompt, num_samples=2, sampling_params=types.SamplingParams(max_tokens=16, temperature=1.0, seed=5, stop=["<|im_end|>"])
    ).result(timeout=120)
    for seq in string_stop.sequences:
        text = tokenizer.decode(seq.tokens)
        if seq.stop_reason == "stop":
            assert text.endswith("<|im_end|>") and text.count("<|im_end|>") == 1

    # compute_logprobs agrees with the training forward pass on the same weights.
    full = data[0].model_input.to_ints() + [data[0].loss_fn_inputs["target_tokens"].tolist()[-1]]
    scored = sampling_client.compute_logprobs(types.ModelInput.from_ints(full)).result(timeout=120)
    assert scored[0] is None and len(scored) == len(full)
    trained = training_client.forward([data[0]], "cross_entropy").result(timeout=120)
    np.testing.assert_allclose(scored[1:], trained.loss_fn_outputs[0]["logprobs"].tolist(), atol=2e-4)

    # Ephemeral sampler straight from the training client.
    ephemeral = training_client.save_weights_and_get_sampling_client().result(timeout=120)
    greedy = ephemeral.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0)).result(timeout=120)
    again = sampling_client.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0)).result(timeout=120)
    assert greedy.sequences[0].tokens == again.sequences[0].tokens

    # A sampler can also serve a training-state path (LoRA state on the base model).
    from_state = service_client.create_sampling_client(model_path=state.path).result(timeout=60)
    state_scored = from_state.compute_logprobs(types.ModelInput.from_ints(full)).result(timeout=120)
    np.testing.assert_allclose(state_scored[1:], scored[1:], atol=1e-4)  # the trained weights ...
    base = service_client.create_sampling_client(base_model=BASE_MODEL).result(timeout=60)
    base_scored = base.compute_logprobs(types.ModelInput.from_ints(full)).result(timeout=120)
    assert max(abs(a - b) for a, b in zip(state_scored[1:], base_scored[1:])) > 1e-3  # ... not the base model's

    # Resume from the saved state, optimizer included: same weights, same loss.
    resumed = service_client.create_training_client_from_state_with_optimizer(state.path).result(timeout=120)
    assert resumed.model_id != training_client.model_id
    resumed_out = resumed.forward(data, "cross_entropy").result(timeout=120)
    assert resumed_out.metrics["loss:sum"] == pytest.approx(after.metrics["loss:sum"], rel=1e-5)
    resumed.forward_backward(data, "cross_entropy").result(timeout=120)
    resumed.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=120)

    # The run record the cookbook reads on resume.
    rest = tinker.RestClient(base_url=base_url)
    run = rest.get_training_run_by_tinker_path(state.path).result(timeout=30)
    assert run.training_run_id == training_client.model_id
    assert run.is_lora and run.lora_rank == 8 and run.base_model == SERVED_NAME
    assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == state.path


def test_sparse_targets_and_multi_target_cross_entropy(training_client, tokenizer):
    """2-D target_tokens/weights go out as sparse CSR; [T, K] targets sum K cross-entropies."""
    tokens = tokenizer.encode("40+2=42")
    inputs, targets = tokens[:-1], tokens[1:]
    n = len(inputs)
    k = 4
    target_matrix = torch.zeros((n, k), dtype=torch.int64)
    weight_matrix = torch.zeros((n, k), dtype=torch.float32)
    target_matrix[:, 0] = torch.tensor(targets)
    weight_matrix[:, 0] = 1.0
    target_matrix[n - 1, 1] = targets[0]
    weight_matrix[n - 1, 1] = 0.5
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(inputs),
        loss_fn_inputs={"target_tokens": target_matrix, "weights": weight_matrix},
    )
    assert datum.loss_fn_inputs["target_tokens"].sparse_crow_indices is not None  # the SDK chose CSR
    out = training_client.forward([datum], "cross_entropy").result(timeout=120)
    logprobs = np.asarray(out.loss_fn_outputs[0]["logprobs"].data).reshape(out.loss_fn_outputs[0]["logprobs"].shape)
    assert logprobs.shape == (n, k)
    plain = types.Datum(model_input=types.ModelInput.from_ints(inputs), loss_fn_inputs={"target_tokens": targets, "weights": [1.0] * n})
    dense = training_client.forward([plain], "cross_entropy").result(timeout=120)
    np.testing.assert_allclose(logprobs[:, 0], dense.loss_fn_outputs[0]["logprobs"].tolist(), atol=1e-5)
    expected = -(logprobs[:, 0].sum() + 0.5 * logprobs[n - 1, 1])
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4)


def test_chunked_forward_backward(service_client, tokenizer):
    """A forward_backward split into chunks (posted concurrently, first chunk last) gives
    the same loss as one request and keeps the model's request order."""
    client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4).result(timeout=120)
    client.holder._client_config = client.holder._client_config.model_copy(update={"fwdbwd_max_chunk_len": 2})
    data = [sft_datum(tokenizer, f"{a}+{a + 1}=", str(2 * a + 1)) for a in range(7)]
    chunked = client.forward(data, "cross_entropy").result(timeout=120)
    assert len(chunked.loss_fn_outputs) == 7
    single = sum(client.forward([d], "cross_entropy").result(timeout=120).metrics["loss:sum"] for d in data)
    assert chunked.metrics["loss:sum"] == pytest.approx(single, rel=1e-4)


def test_sessions_listing_and_checkpoint_delete(base_url, service_client, training_client):
    rest = tinker.RestClient(base_url=base_url)
    session_id = service_client.holder.get_session_id()
    assert session_id in rest.list_sessions().result(timeout=30).sessions
    details = rest.get_session(session_id).result(timeout=30)
    assert training_client.model_id in details.training_run_ids
    path = training_client.save_state("to-delete").result(timeout=120).path
    rest.delete_checkpoint_from_tinker_path(path).result(timeout=30)
    with pytest.raises(tinker.NotFoundError, match="unknown checkpoint"):
        service_client.create_training_client_from_state(path).result(timeout=60)


def test_server_capabilities(base_url):
    rest = tinker.RestClient(base_url=base_url)
    capabilities = rest.get_server_capabilities().result(timeout=30)
    assert [m.model_name for m in capabilities.supported_models] == [SERVED_NAME]


def test_base_model_sampler_and_full_finetune(service_client, tokenizer):
    full = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=0).result(timeout=120)
    assert full.get_info().is_lora is False
    base_sampler = service_client.create_sampling_client(base_model=BASE_MODEL).result(timeout=60)
    prompt = types.ModelInput.from_ints(chat_prompt(tokenizer, "3+4="))
    out = base_sampler.sample(prompt, 2, types.SamplingParams(max_tokens=5, temperature=0.0)).result(timeout=60)
    assert out.sequences[0].tokens == out.sequences[1].tokens
    datum = sft_datum(tokenizer, "3+4=", "7")
    before = full.forward([datum], "cross_entropy").result(timeout=60).loss_fn_outputs[0]["logprobs"].tolist()
    scored = base_sampler.compute_logprobs(
        types.ModelInput.from_ints(datum.model_input.to_ints() + [datum.loss_fn_inputs["target_tokens"].tolist()[-1]])
    ).result(timeout=60)
    assert all(math.isclose(a, b, abs_tol=2e-4) for a, b in zip(scored[1:], before))


def test_stop_strings_keep_stopping_at_eos(service_client, tokenizer):
    """As hosted Tinker: the ``role_colon`` renderer's stop strings do not turn off the
    end-of-sequence stop, so a sample the model ends ends there, not at ``max_tokens``."""
    sampler = service_client.create_sampling_client(base_model=BASE_MODEL).result(timeout=60)
    prompt = types.ModelInput.from_ints(chat_prompt(tokenizer, "3+4="))
    params = types.SamplingParams(max_tokens=12, temperature=0.0, stop=["\n\nUser:"])
    sequence = sampler.sample(prompt, 1, params).result(timeout=60).sequences[0]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert sequence.stop_reason == "stop"
    assert sequence.tokens[-1] == im_end and im_end not in sequence.tokens[:-1]
