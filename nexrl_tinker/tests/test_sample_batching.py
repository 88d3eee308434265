"""Concurrent seeded ``asample`` requests share engine calls without changing any result.

The RL loops send one single-prompt request per agent run, each with its own seed, and
other clients sample the same weights with other settings meanwhile (a greedy check,
another temperature, token budget or stop). The service batches every pending request
into one decode loop whatever its sampling parameters; a request's tokens must be those
it gets when sent alone.
"""

from __future__ import annotations

import threading
import time

import pytest
from tinker import types

from nexrl_engine.engine import Engine
from nexrl_tinker.testing import BASE_MODEL


@pytest.fixture
def engine_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Prompts per `Engine.sample` call (and in ``engine_calls.settings`` how many
    different sampling settings each call held); the first call is held back 0.5 s so
    that the requests sent meanwhile are pending together when the lane frees up."""
    calls = _Calls()
    lock = threading.Lock()
    original = Engine.sample

    def spy(self, prompts, params=None, *args, **kwargs):
        with lock:
            first = not calls
            calls.append(len(prompts))
            calls.settings.append(len({repr(own) for own in params}) if isinstance(params, list) else 1)
        if first:
            time.sleep(0.5)
        return original(self, prompts, params, *args, **kwargs)

    monkeypatch.setattr(Engine, "sample", spy)
    return calls


class _Calls(list):
    def __init__(self) -> None:
        super().__init__()
        self.settings: list[int] = []


def _requests() -> list[tuple[list[int], types.SamplingParams, int]]:
    """(prompt, params, num_samples): varied prompt lengths and seeds, a request for two
    samples (counts may differ within a batch), and requests that sample otherwise:
    another temperature, greedy, top-k and top-p, another token budget, stop tokens and
    stop strings."""
    out = []
    for index in range(12):
        prompt = [1] + [30 + (7 * index + k) % 200 for k in range(3 + index % 5)]
        out.append((prompt, types.SamplingParams(max_tokens=10, temperature=1.0, seed=100 + index), 1))
    out.append(([1, 40, 41, 42], types.SamplingParams(max_tokens=10, temperature=0.7, seed=5), 1))
    out.append(([1, 44, 45], types.SamplingParams(max_tokens=7, temperature=0.0), 1))
    out.append(([1, 46, 47, 48], types.SamplingParams(max_tokens=14, temperature=1.2, top_k=4, top_p=0.9, seed=8), 2))
    out.append(([1, 52], types.SamplingParams(max_tokens=12, temperature=1.0, stop=[35, 36, 37], seed=9), 1))
    out.append(([1, 53, 54], types.SamplingParams(max_tokens=12, temperature=1.0, stop=["1"], seed=10), 1))
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
    assert max(engine_calls.settings) > 3, f"requests that sample otherwise were not batched together: {engine_calls.settings}"
    assert sum(engine_calls) == len(requests)

    for got, expected in zip(together, alone):
        assert [(tokens, reason) for tokens, _, reason in got] == [(tokens, reason) for tokens, _, reason in expected]
        for (_, a, _), (_, b, _) in zip(got, expected):
            assert a == pytest.approx(b, abs=1e-4)
    assert len({tuple(seqs[0][0]) for seqs in together}) > len(together) // 2, "seeds must give different samples"
