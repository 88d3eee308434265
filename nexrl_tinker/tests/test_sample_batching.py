"""Concurrent seeded ``asample`` requests share engine calls without changing any result.

The RL loops send one single-prompt request per agent run, each with its own seed. The
service batches pending requests whose sampling parameters differ only in the seed; a
request's tokens must be those it gets when sent alone.
"""

from __future__ import annotations

import threading
import time

import pytest
from nexrl_engine.engine import Engine
from nexrl_tinker.testing import BASE_MODEL
from tinker import types


@pytest.fixture
def engine_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Prompts per `Engine.sample` call; the first call is held back 0.5 s so that the
    requests sent meanwhile are pending together when the lane frees up."""
    calls: list[int] = []
    lock = threading.Lock()
    original = Engine.sample

    def spy(self, prompts, *args, **kwargs):
        with lock:
            first = not calls
            calls.append(len(prompts))
        if first:
            time.sleep(0.5)
        return original(self, prompts, *args, **kwargs)

    monkeypatch.setattr(Engine, "sample", spy)
    return calls


def _requests() -> list[tuple[list[int], types.SamplingParams, int]]:
    """(prompt, params, num_samples): varied prompt lengths and seeds, a request for two
    samples (counts may differ within a batch), and one that must not join the batch
    (another temperature)."""
    out = []
    for index in range(12):
        prompt = [1] + [30 + (7 * index + k) % 200 for k in range(3 + index % 5)]
        out.append((prompt, types.SamplingParams(max_tokens=10, temperature=1.0, seed=100 + index), 1))
    out.append(([1, 40, 41, 42], types.SamplingParams(max_tokens=10, temperature=0.7, seed=5), 1))
    out.append(([1, 50, 51], types.SamplingParams(max_tokens=10, temperature=1.0, seed=6), 2))
    out.append(([1, 60], types.SamplingParams(max_tokens=10, temperature=1.0, seed=7), 1))
    return out


def _sequences(response: types.SampleResponse) -> list[tuple[list[int], list[float], str]]:
    return [(list(s.tokens), list(s.logprobs or []), str(s.stop_reason)) for s in response.sequences]


def test_concurrent_seeded_requests_are_batched_and_sample_as_if_alone(service_client, engine_calls: list[int]) -> None:
    sampler = service_client.create_sampling_client(base_model=BASE_MODEL).result(timeout=120)
    requests = _requests()

    alone = []
    for prompt, params, n in requests:
        alone.append(_sequences(sampler.sample(types.ModelInput.from_ints(prompt), n, params).result(timeout=120)))
    assert engine_calls == [1] * len(requests)

    engine_calls.clear()
    futures = [sampler.sample(types.ModelInput.from_ints(prompt), n, params) for prompt, params, n in requests]
    together = [_sequences(future.result(timeout=120)) for future in futures]
    assert max(engine_calls) > 1, f"nothing was batched: {engine_calls}"
    assert sum(engine_calls) == len(requests)

    for got, expected in zip(together, alone):
        assert [(tokens, reason) for tokens, _, reason in got] == [(tokens, reason) for tokens, _, reason in expected]
        for (_, a, _), (_, b, _) in zip(got, expected):
            assert a == pytest.approx(b, abs=1e-4)
    assert len({tuple(seqs[0][0]) for seqs in together}) > len(together) // 2, "seeds must give different samples"
