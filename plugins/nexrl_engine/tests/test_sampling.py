"""Sampling: shapes, stop rules, seeds, and logprobs that equal a teacher-forced pass."""

from __future__ import annotations

import math

import attrs
import pytest
import torch

from nexrl_engine import Datum, Engine, SamplingParams
from nexrl_engine.types import LogprobRequest, PromptTargets

IM_END = 2


def test_shapes(shared_engine: Engine, chat_prompts: list[list[int]]) -> None:
    results = shared_engine.sample(chat_prompts[:3], SamplingParams(max_tokens=5, stop=[], seed=1), num_samples=4)
    assert len(results) == 3
    for result in results:
        assert result.prompt_logprobs is None
        assert len(result.sequences) == 4
        for sequence in result.sequences:
            assert len(sequence.tokens) == len(sequence.logprobs) == 5
            assert sequence.stop_reason == "length"
            assert all(math.isfinite(lp) and lp <= 0 for lp in sequence.logprobs)


def test_default_stop_is_eos(shared_engine: Engine, chat_prompts: list[list[int]]) -> None:
    results = shared_engine.sample(chat_prompts, SamplingParams(max_tokens=8, temperature=0.0))
    for result in results:
        sequence = result.sequences[0]
        assert sequence.stop_reason == "stop"
        assert sequence.tokens[-1] == IM_END and IM_END not in sequence.tokens[:-1]
        text = shared_engine.tokenizer.decode(sequence.tokens, skip_special_tokens=True)
        assert text.isdigit()


def test_empty_stop_runs_to_max_tokens(shared_engine: Engine, chat_prompts: list[list[int]]) -> None:
    results = shared_engine.sample(chat_prompts[:4], SamplingParams(max_tokens=9, temperature=0.0, stop=[]))
    for result in results:
        sequence = result.sequences[0]
        assert len(sequence.tokens) == 9 and sequence.stop_reason == "length"
        assert IM_END in sequence.tokens  # the EOS the model emits does not stop it


def test_stop_strings_still_stop_at_eos(shared_engine: Engine, chat_prompts: list[list[int]]) -> None:
    """A stop-string list the model never writes (the ``role_colon`` renderer's) ends the
    sample at EOS, as without one, instead of running on to ``max_tokens``."""
    params = SamplingParams(max_tokens=8, temperature=0.0, stop=["\n\nUser:"])
    for result in shared_engine.sample(chat_prompts, params):
        sequence = result.sequences[0]
        assert sequence.stop_reason == "stop"
        assert sequence.tokens[-1] == IM_END and IM_END not in sequence.tokens[:-1]


def test_stop_token_ids(shared_engine: Engine, chat_prompts: list[list[int]]) -> None:
    params = SamplingParams(max_tokens=10, temperature=0.0, stop=[])
    full = shared_engine.sample(chat_prompts[:1], params)[0].sequences[0].tokens
    stop_token = full[3]
    cut = shared_engine.sample(chat_prompts[:1], SamplingParams(max_tokens=10, temperature=0.0, stop=[stop_token]))
    sequence = cut[0].sequences[0]
    assert sequence.stop_reason == "stop"
    assert sequence.tokens == full[: full.index(stop_token) + 1]


def test_stop_strings(shared_engine: Engine, chat_prompts: list[list[int]]) -> None:
    decode = shared_engine._decode_raw
    full = shared_engine.sample(chat_prompts[:1], SamplingParams(max_tokens=10, temperature=0.0, stop=[]))[0].sequences[0].tokens
    text = decode(full)
    stop = text[2:5]  # spans token boundaries in general
    sequence = shared_engine.sample(chat_prompts[:1], SamplingParams(max_tokens=10, temperature=0.0, stop=stop))[0].sequences[0]
    assert sequence.stop_reason == "stop"
    assert stop in decode(sequence.tokens)
    assert stop not in decode(sequence.tokens[:-1])
    assert sequence.tokens == full[: len(sequence.tokens)]


def test_same_seed_same_samples(shared_engine: Engine, chat_prompts: list[list[int]]) -> None:
    params = SamplingParams(max_tokens=6, stop=[], seed=123, temperature=1.5)
    first = shared_engine.sample(chat_prompts[:3], params, num_samples=3)
    second = shared_engine.sample(chat_prompts[:3], params, num_samples=3)
    assert first == second
    other = shared_engine.sample(chat_prompts[:3], SamplingParams(max_tokens=6, stop=[], seed=124, temperature=1.5), num_samples=3)
    assert [s.tokens for r in first for s in r.sequences] != [s.tokens for r in other for s in r.sequences]
    # A sample does not depend on what else is in the batch.
    alone = shared_engine.sample(chat_prompts[:1], params, num_samples=3)
    assert [s.tokens for s in alone[0].sequences] == [s.tokens for s in first[0].sequences]


@pytest.mark.parametrize("num_samples", [1, 3])
def test_per_prompt_seeds_sample_as_if_alone(shared_engine: Engine, chat_prompts: list[list[int]], num_samples: int) -> None:
    """A prompt with its own seed samples the same in any batch as alone with that seed:
    different seeds and prompt lengths (left padding) in one call, stop rules that end
    rows at different steps. Tokens and stop reasons are equal; logprobs up to float
    rounding (CPU matrix kernels round a row differently by batch size and padding)."""
    by_length = {len(p): p for p in chat_prompts}
    prompts = [by_length[max(by_length)], [1, 30, 31], *chat_prompts[:6], by_length[min(by_length)] + [40, 41, 42, 43]]
    assert len({len(p) for p in prompts}) >= 4
    seeds = [1000 + 17 * index for index in range(len(prompts))]
    seeds[3] = seeds[4]  # two prompts may share a seed
    params = SamplingParams(max_tokens=8, temperature=1.3)
    batched = shared_engine.sample(prompts, params, seeds=seeds, num_samples=num_samples)
    reversed_batch = shared_engine.sample(prompts[::-1], params, seeds=seeds[::-1], num_samples=num_samples)[::-1]
    for prompt, seed, together, backwards in zip(prompts, seeds, batched, reversed_batch):
        alone = shared_engine.sample([prompt], attrs.evolve(params, seed=seed), num_samples=num_samples)[0]
        assert len(together.sequences) == len(alone.sequences) == num_samples
        for got in (together, backwards):
            for a, b in zip(got.sequences, alone.sequences):
                assert (a.tokens, a.stop_reason) == (b.tokens, b.stop_reason)
                assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    # The draws really are per prompt: different seeds, different samples.
    tokens = [tuple(s.tokens) for r in batched for s in r.sequences]
    assert len(set(tokens)) > len(tokens) // 2
    assert {len(s.tokens) for r in batched for s in r.sequences} != {8}, "want rows that stop early"


def test_seeds_fall_back_to_the_call_seed_by_position(shared_engine: Engine, chat_prompts: list[list[int]]) -> None:
    params = SamplingParams(max_tokens=6, stop=[], seed=42)
    plain = shared_engine.sample(chat_prompts[:3], params, num_samples=2)
    assert shared_engine.sample(chat_prompts[:3], params, num_samples=2, seeds=[None, None, None]) == plain
    mixed = shared_engine.sample(chat_prompts[:3], params, num_samples=2, seeds=[None, 7, None])
    assert [mixed[0].sequences[i].tokens for i in range(2)] == [plain[0].sequences[i].tokens for i in range(2)]
    assert [mixed[2].sequences[i].tokens for i in range(2)] == [plain[2].sequences[i].tokens for i in range(2)]
    alone = shared_engine.sample(chat_prompts[1:2], attrs.evolve(params, seed=7), num_samples=2)[0]
    assert [s.tokens for s in mixed[1].sequences] == [s.tokens for s in alone.sequences]


def test_sample_j_of_seed_s_is_the_only_sample_of_seed_s_plus_j(shared_engine: Engine, chat_prompts: list[list[int]]) -> None:
    """The contract that lets a client merge single-sample requests with consecutive
    seeds into one ``num_samples`` request (and split it again) without changing a sample."""
    params = SamplingParams(max_tokens=8, temperature=1.2)
    prompt = chat_prompts[2]
    merged = shared_engine.sample([prompt], params, num_samples=5, seeds=[900])[0].sequences
    singles = [shared_engine.sample([prompt], params, seeds=[900 + j])[0].sequences[0] for j in range(5)]
    via_call_seed = shared_engine.sample([prompt], attrs.evolve(params, seed=900), num_samples=5)[0].sequences
    for together, alone, by_call in zip(merged, singles, via_call_seed):
        assert together.tokens == alone.tokens == by_call.tokens
        assert together.logprobs == pytest.approx(alone.logprobs, abs=1e-4)
    assert len({tuple(s.tokens) for s in merged}) > 1, "consecutive seeds must still draw different samples"


def test_each_prompt_may_have_its_own_sample_count(shared_engine: Engine, chat_prompts: list[list[int]]) -> None:
    """Requests asking for different numbers of samples can share one batch."""
    params = SamplingParams(max_tokens=6, temperature=1.1)
    prompts, counts, seeds = chat_prompts[:3], [2, 1, 4], [50, 60, 70]
    together = shared_engine.sample(prompts, params, num_samples=counts, seeds=seeds)
    assert [len(result.sequences) for result in together] == counts
    for prompt, count, seed, got in zip(prompts, counts, seeds, together):
        alone = shared_engine.sample([prompt], params, num_samples=count, seeds=[seed])[0]
        assert [s.tokens for s in got.sequences] == [s.tokens for s in alone.sequences]


@pytest.mark.parametrize(
    ("num_samples", "message"),
    [(0, "integers >= 1"), ([1, 2], "2 counts for 3 prompts"), ([1, 0, 1], "integers >= 1"), (True, "integers >= 1")],
)
def test_bad_sample_counts(shared_engine: Engine, num_samples, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        shared_engine.sample([[1, 2], [3, 4], [5, 6]], SamplingParams(max_tokens=2), num_samples=num_samples)


@pytest.mark.parametrize(
    ("seeds", "message"),
    [
        ([1], "seeds has 1 entries for 2 prompts"),
        ([1, True], r"seeds\[1\] must be an integer or None"),
        ([1, 2.0], r"seeds\[1\] must be an integer or None"),
        ("ab", "seeds must be a list"),
    ],
)
def test_bad_seeds(shared_engine: Engine, seeds, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        shared_engine.sample([[1, 2], [3, 4]], SamplingParams(max_tokens=2), seeds=seeds)


def test_top_k_one_and_tiny_top_p_are_greedy(shared_engine: Engine, chat_prompts: list[list[int]]) -> None:
    greedy = shared_engine.sample(chat_prompts[:4], SamplingParams(max_tokens=6, temperature=0.0, stop=[]))
    top_k = shared_engine.sample(chat_prompts[:4], SamplingParams(max_tokens=6, top_k=1, stop=[], seed=5))
    top_p = shared_engine.sample(chat_prompts[:4], SamplingParams(max_tokens=6, top_p=1e-6, stop=[], seed=5))
    tokens = lambda results: [r.sequences[0].tokens for r in results]  # noqa: E731
    assert tokens(greedy) == tokens(top_k) == tokens(top_p)
    # Reported logprobs stay those of the raw model even though the filter changed the draw.
    for a, b in zip(greedy, top_k):
        assert a.sequences[0].logprobs == pytest.approx(b.sequences[0].logprobs, abs=1e-6)


def test_logprobs_match_teacher_forcing_left_padded(shared_engine: Engine, chat_prompts: list[list[int]]) -> None:
    """Mixed-length prompts are left-padded in one batch; every sampled logprob must equal
    a teacher-forced forward pass over prompt + response (fp32, 1e-4)."""
    by_length = {len(p): p for p in chat_prompts}
    short, long = by_length[min(by_length)], by_length[max(by_length)]
    prompts = [long, [1, 30, 31], short + [40, 41, 42, 43, 44, 45, 46], short]
    assert len({len(p) for p in prompts}) == len(prompts)
    results = shared_engine.sample(prompts, SamplingParams(max_tokens=12, stop=[], seed=7), num_samples=2)
    sequences = [prompt + s.tokens for prompt, r in zip(prompts, results) for s in r.sequences]
    forced = shared_engine.compute_logprobs(sequences)
    worst = 0.0
    index = 0
    for prompt, result in zip(prompts, results):
        for sequence in result.sequences:
            expected = forced[index][len(prompt) :]
            worst = max(worst, max(abs(a - b) for a, b in zip(sequence.logprobs, expected)))
            index += 1
    assert worst <= 1e-4
    # The training forward pass agrees too.
    datums = [
        Datum(input_tokens=seq[:-1], loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)}) for seq in sequences
    ]
    outputs = shared_engine.forward(datums, "cross_entropy").outputs
    index = 0
    for prompt, result in zip(prompts, results):
        for sequence in result.sequences:
            tail = outputs[index].logprobs[len(prompt) - 1 :]
            assert max(abs(a - b) for a, b in zip(sequence.logprobs, tail)) <= 1e-4
            index += 1


def test_stopped_rows_keep_correct_logprobs(shared_engine: Engine, chat_prompts: list[list[int]]) -> None:
    """Rows leave the batch when they stop; the rest must stay exact."""
    results = shared_engine.sample(chat_prompts[:6], SamplingParams(max_tokens=8, seed=3), num_samples=3)
    lengths = {len(s.tokens) for r in results for s in r.sequences}
    sequences = [prompt + s.tokens for prompt, r in zip(chat_prompts, results) for s in r.sequences]
    forced = shared_engine.compute_logprobs(sequences)
    index = 0
    for prompt, result in zip(chat_prompts, results):
        for sequence in result.sequences:
            assert sequence.logprobs == pytest.approx(forced[index][len(prompt) :], abs=1e-4)
            index += 1
    assert len(lengths) >= 2, "rows must stop at different lengths for this to test anything"


def test_prompt_logprobs(shared_engine: Engine, chat_prompts: list[list[int]]) -> None:
    prompts = [chat_prompts[0], chat_prompts[3][:5], [7]]
    results = shared_engine.sample(prompts, SamplingParams(max_tokens=1, seed=0), include_prompt_logprobs=True)
    forced = shared_engine.compute_logprobs(prompts)
    for prompt, result, expected in zip(prompts, results, forced):
        assert result.prompt_logprobs is not None and len(result.prompt_logprobs) == len(prompt)
        assert result.prompt_logprobs[0] is None and expected[0] is None
        assert result.prompt_logprobs[1:] == pytest.approx(expected[1:], abs=1e-4)


def _log_softmax(engine: Engine, sequence: list[int]) -> torch.Tensor:
    """Row j: log p(· | sequence[: j + 1]), one unpadded forward pass of the sequence alone."""
    with torch.no_grad():
        return torch.log_softmax(engine.model(torch.tensor([sequence])).logits[0].float(), dim=-1)


def test_topk_and_target_logprobs_in_a_mixed_batch(shared_engine: Engine, chat_prompts: list[list[int]]) -> None:
    """Left-padded prompts, each with its own widths and targets, rows that stop at
    different lengths (and leave the batch): every row's top-k and every target cell
    equal the sequence's own log-softmax."""
    prompts = [chat_prompts[0], chat_prompts[3][:5], [7]]
    requests = [
        LogprobRequest(topk_prompt_logprobs=3, topk_sample_logprobs=2, target_prompt_logprobs=PromptTargets([1, 4, 4], [9, 2, 0])),
        LogprobRequest(topk_prompt_logprobs=1, topk_sample_logprobs=4),
        None,
    ]
    results = shared_engine.sample(prompts, SamplingParams(max_tokens=8, seed=3), num_samples=3, logprobs=requests)
    assert len({len(s.tokens) for r in results[:2] for s in r.sequences}) >= 2, "rows must stop at different lengths"
    for prompt, request, result in zip(prompts, requests, results):
        if request is None:
            assert result.topk_prompt_logprobs is None and result.target_prompt_logprobs is None
            assert all(s.topk_logprobs is None for s in result.sequences)
            continue
        reference = _log_softmax(shared_engine, prompt)
        top = result.topk_prompt_logprobs
        assert top is not None and len(top.token_ids) == len(prompt) - 1
        expected = reference[:-1].topk(request.topk_prompt_logprobs)
        assert top.token_ids == expected.indices.tolist()
        for row, values in zip(top.logprobs, expected.values.tolist()):
            assert row == pytest.approx(values, abs=1e-4)
        targets = request.target_prompt_logprobs
        if targets is not None:
            wanted = [float(reference[p - 1, t]) for p, t in zip(targets.positions, targets.token_ids)]
            assert result.target_prompt_logprobs == pytest.approx(wanted, abs=1e-4)
        for sequence in result.sequences:
            forced = _log_softmax(shared_engine, prompt + sequence.tokens)[len(prompt) - 1 : -1]
            assert sequence.topk_logprobs is not None and len(sequence.topk_logprobs.token_ids) == len(sequence.tokens)
            expected = forced.topk(request.topk_sample_logprobs)
            assert sequence.topk_logprobs.token_ids == expected.indices.tolist()
            for row, values in zip(sequence.topk_logprobs.logprobs, expected.values.tolist()):
                assert row == pytest.approx(values, abs=1e-4)


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (LogprobRequest(topk_prompt_logprobs=-1), "topk_prompt_logprobs must be an integer from 0"),
        (LogprobRequest(topk_sample_logprobs=5000), "topk_sample_logprobs must be an integer from 0"),
        (LogprobRequest(target_prompt_logprobs=PromptTargets([0], [3])), "positions must be from 1"),
        (LogprobRequest(target_prompt_logprobs=PromptTargets([1], [5000])), "in the vocabulary"),
        (LogprobRequest(target_prompt_logprobs=PromptTargets([1, 2], [3])), "2 positions for 1 token ids"),
    ],
)
def test_bad_logprob_requests(shared_engine: Engine, request_: LogprobRequest, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        shared_engine.sample([[1, 2, 3]], SamplingParams(max_tokens=2), logprobs=request_)


@pytest.mark.parametrize(
    ("prompts", "kwargs", "message"),
    [
        ([[]], {}, "prompt 0 is empty"),
        ([[1, 2], []], {}, "prompt 1 is empty"),
        ([], {}, "non-empty list"),
        ([[1, 5000]], {}, r"prompt 0 has token ids \[5000\] outside the vocabulary"),
        ([[1, 2]], {"num_samples": 0}, "num_samples must be"),
        ("hello", {}, "non-empty list of token id lists"),
    ],
)
def test_bad_sampling_input(shared_engine: Engine, prompts, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        shared_engine.sample(prompts, SamplingParams(max_tokens=2), **kwargs)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k must be"),
        ({"max_tokens": 0}, "max_tokens must be"),
        ({"stop": ["a", 3]}, "not a mix"),
        ({"stop": [""]}, "must not be empty"),
    ],
)
def test_bad_sampling_params(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


def test_stop_token_out_of_vocab(shared_engine: Engine) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        shared_engine.sample([[1, 2]], SamplingParams(max_tokens=2, stop=[99999]))
