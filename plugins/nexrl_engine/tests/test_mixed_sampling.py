"""Prompts that sample differently share one decode loop, each getting what it gets alone.

A service batches its concurrent sample requests into one engine call; requests rarely
agree on everything (a greedy validation request next to rollouts at temperature 1, a
different token budget, other stop strings). `Engine.sample` with one `SamplingParams`
per prompt runs them in one loop (one decode call), and every prompt's samples are those
of `Engine.sample([prompt], its params)`: the same tokens and stop reasons, logprobs
equal up to float rounding of batched matrix products.
"""

from __future__ import annotations

import pytest

from nexrl_engine import Engine
from nexrl_engine.decode import COUNTERS
from nexrl_engine.types import SamplingParams


def _mixed(engine: Engine) -> list[tuple[SamplingParams, int]]:
    """Each prompt's params and sample count: every filter, stop kind and budget differ."""
    newline = engine.tokenizer.encode("\n", add_special_tokens=False)
    return [
        (SamplingParams(temperature=0.0, max_tokens=6), 1),
        (SamplingParams(temperature=1.0, top_k=5, max_tokens=12, seed=11), 3),
        (SamplingParams(temperature=0.7, top_p=0.8, max_tokens=16, stop=newline, seed=12), 2),
        (SamplingParams(temperature=1.3, max_tokens=20, stop=["1", "2"], seed=13), 2),
        (SamplingParams(temperature=1.0, top_k=3, top_p=0.9, max_tokens=9, stop=[], seed=14), 1),
        # unfiltered and hot (a flat distribution): its draws leave any small top-k, so a row given another's top-k shows
        (SamplingParams(temperature=4.0, max_tokens=24, stop=[], seed=15), 2),
    ]


def test_each_prompt_of_a_mixed_batch_samples_as_if_alone(shared_engine: Engine, chat_prompts: list[list[int]]) -> None:
    mixed = _mixed(shared_engine)
    prompts = chat_prompts[: len(mixed)]
    alone = [shared_engine.sample([prompt], params, num_samples=count)[0] for prompt, (params, count) in zip(prompts, mixed)]
    calls = COUNTERS["static_calls"] + COUNTERS["dynamic_calls"]
    together = shared_engine.sample(prompts, [params for params, _ in mixed], num_samples=[count for _, count in mixed])
    assert COUNTERS["static_calls"] + COUNTERS["dynamic_calls"] == calls + 1, "one decode loop for every prompt"
    reasons = set()
    for index, (one, batched) in enumerate(zip(alone, together)):
        assert len(batched.sequences) == len(one.sequences) == mixed[index][1]
        for own, shared in zip(one.sequences, batched.sequences):
            assert shared.tokens == own.tokens, f"prompt {index}"
            assert shared.stop_reason == own.stop_reason, f"prompt {index}"
            assert shared.logprobs == pytest.approx(own.logprobs, abs=1e-4), f"prompt {index}"
            reasons.add((index, own.stop_reason))
    assert {reason for _, reason in reasons} == {"stop", "length"}, f"both ways of ending must occur, or this checks less: {reasons}"
    assert len({len(s.tokens) for p in alone for s in p.sequences}) > 2, "rows of different lengths"


def test_params_need_one_entry_per_prompt(shared_engine: Engine, chat_prompts: list[list[int]]) -> None:
    with pytest.raises(ValueError, match="params has 2 entries for 3 prompts"):
        shared_engine.sample(chat_prompts[:3], [SamplingParams(), SamplingParams()])


def test_greedy_prompts_with_different_filters_are_one_greedy_batch(shared_engine: Engine, chat_prompts: list[list[int]]) -> None:
    """Filters do not matter at temperature 0: such prompts draw nothing, alone or together."""
    mixed = [SamplingParams(temperature=0.0, max_tokens=5), SamplingParams(temperature=0.0, top_k=3, top_p=0.5, max_tokens=7)]
    together = shared_engine.sample(chat_prompts[:2], mixed)
    for prompt, params, batched in zip(chat_prompts[:2], mixed, together):
        assert batched.sequences[0].tokens == shared_engine.sample([prompt], params)[0].sequences[0].tokens
