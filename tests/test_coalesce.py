"""`SampleCoalescer`: concurrent single-sample requests become few multi-sample requests,
and every caller gets the sample its own seed names."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from nexrl_core.chat.model import SamplingOptions
from nexrl_core.training.coalesce import SampleCoalescer, consecutive_runs


class SeedEcho:
    """A `send` that answers sample j of a seed-s request with ``(prompt, s + j)``, the
    seed rule of NexRL's services, and records every request."""

    def __init__(self, fail: bool = False) -> None:
        self.requests: list[tuple[tuple[int, ...], int | None, int]] = []
        self._lock = threading.Lock()
        self._fail = fail

    def __call__(self, prompt: list[int], options: SamplingOptions, n: int) -> Sequence[tuple[tuple[int, ...], int | None]]:
        with self._lock:
            self.requests.append((tuple(prompt), options.seed, n))
        if self._fail:
            raise ConnectionError("service down")
        return [(tuple(prompt), None if options.seed is None else options.seed + j) for j in range(n)]


def call_together(coalescer: SampleCoalescer, calls: list[tuple[list[int], SamplingOptions]]) -> list[object]:
    """Start every call at the same moment from its own thread; results in call order."""
    results: list[object] = [None] * len(calls)
    barrier = threading.Barrier(len(calls))

    def run(index: int) -> None:
        barrier.wait()
        try:
            results[index] = coalescer.sample(*calls[index])
        except Exception as error:  # noqa: BLE001 - the test inspects it
            results[index] = error

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert not any(thread.is_alive() for thread in threads)
    return results


OPTIONS = SamplingOptions(max_tokens=8, temperature=1.0)


def test_consecutive_runs() -> None:
    assert consecutive_runs([5, 3, 4, None, 7, None, 4]) == [[3, 5], [1, 2], [6, 0], [4]]  # seeds 3,4 and 4,5: a repeat starts a new run
    assert consecutive_runs([]) == []
    assert consecutive_runs([10]) == [[0]]


def test_a_group_with_consecutive_seeds_is_one_request_and_each_run_gets_its_own_sample() -> None:
    send = SeedEcho()
    coalescer = SampleCoalescer(send, window_s=0.05)
    seeds = [100 + run for run in range(8)]
    results = call_together(coalescer, [([1, 2, 3], SamplingOptions(max_tokens=8, seed=seed)) for seed in seeds[::-1]])
    assert results == [((1, 2, 3), seed) for seed in seeds[::-1]]
    assert send.requests == [((1, 2, 3), 100, 8)]


def test_only_equal_prompts_and_options_with_consecutive_seeds_merge() -> None:
    send = SeedEcho()
    coalescer = SampleCoalescer(send, window_s=0.05)
    calls = [
        ([1], SamplingOptions(seed=10)),
        ([1], SamplingOptions(seed=11)),
        ([1], SamplingOptions(seed=13)),  # a gap: its own request
        ([2], SamplingOptions(seed=12)),  # another prompt
        ([1], SamplingOptions(seed=12, temperature=0.5)),  # other options
        ([1], SamplingOptions(stop=["x"], seed=14)),
        ([1], SamplingOptions(stop=["x"], seed=15)),
        ([1], SamplingOptions(seed=None)),
        ([1], SamplingOptions(seed=None)),
    ]
    results = call_together(coalescer, calls)
    assert results == [((tuple(prompt)), options.seed) for prompt, options in calls]
    assert sorted(send.requests, key=repr) == sorted(
        [((1,), 10, 2), ((1,), 13, 1), ((2,), 12, 1), ((1,), 12, 1), ((1,), 14, 2), ((1,), None, 2)], key=repr
    )


def test_a_repeated_seed_is_sent_again_not_shared() -> None:
    send = SeedEcho()
    coalescer = SampleCoalescer(send, window_s=0.05)
    results = call_together(coalescer, [([4], SamplingOptions(seed=7)) for _ in range(3)])
    assert results == [((4,), 7)] * 3
    assert send.requests == [((4,), 7, 1)] * 3


def test_window_zero_sends_each_call_alone() -> None:
    send = SeedEcho()
    coalescer = SampleCoalescer(send, window_s=0)
    results = call_together(coalescer, [([1], SamplingOptions(seed=seed)) for seed in (1, 2, 3)])
    assert results == [((1,), 1), ((1,), 2), ((1,), 3)]
    assert sorted(send.requests) == [((1,), 1, 1), ((1,), 2, 1), ((1,), 3, 1)]


def test_a_failed_request_fails_every_call_it_carried() -> None:
    coalescer = SampleCoalescer(SeedEcho(fail=True), window_s=0.05)
    results = call_together(coalescer, [([1], SamplingOptions(seed=seed)) for seed in (1, 2, 3)])
    assert all(isinstance(result, ConnectionError) for result in results)


def test_a_service_that_returns_too_few_samples_is_an_error() -> None:
    coalescer = SampleCoalescer(lambda prompt, options, n: [("only one",)], window_s=0.05)
    results = call_together(coalescer, [([1], SamplingOptions(seed=seed)) for seed in (1, 2)])
    assert all(isinstance(result, RuntimeError) and "asked the service for 2" in str(result) for result in results)


def test_later_calls_start_a_new_batch() -> None:
    send = SeedEcho()
    coalescer = SampleCoalescer(send, window_s=0.01)
    assert coalescer.sample([1], SamplingOptions(seed=1)) == ((1,), 1)
    assert coalescer.sample([1], SamplingOptions(seed=2)) == ((1,), 2)
    assert send.requests == [((1,), 1, 1), ((1,), 2, 1)]


@pytest.mark.parametrize("window", [0.0, 0.02])
def test_options_pass_through(window: float) -> None:
    seen: list[SamplingOptions] = []

    def send(prompt: list[int], options: SamplingOptions, n: int) -> list[int]:
        seen.append(options)
        return [0] * n

    SampleCoalescer(send, window_s=window).sample([1], SamplingOptions(max_tokens=3, top_k=5, stop=[9], seed=4))
    assert seen == [SamplingOptions(max_tokens=3, top_k=5, stop=[9], seed=4)]
