"""The in-process compute thread: how sample requests become engine calls, and shutdown."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest

from nexrl_engine.compute import ComputeThread, SampleRequest, plan_call
from nexrl_engine.types import SampledSequence, SamplingParams

HOT = SamplingParams(max_tokens=4, temperature=1.0)
COLD = SamplingParams(max_tokens=4, temperature=0.0)


def request(prompt: Sequence[int], seed: int | None, params: SamplingParams = HOT) -> SampleRequest:
    return SampleRequest(tuple(prompt), params, seed)


def test_a_group_with_consecutive_seeds_is_one_prompt_row() -> None:
    requests = [request([1, 2], 12), request([1, 2], 10), request([1, 2], 11), request([3], 10)]
    call = plan_call(requests)
    assert call.params == [HOT, HOT]
    assert call.prompts == [[1, 2], [3]]
    assert call.seeds == [10, 10]
    assert call.counts == [3, 1]
    assert call.members == [[1, 2, 0], [3]], "sample j of seed s answers the request with seed s + j"


def test_seed_gaps_split_rows_and_other_params_get_rows_of_their_own_in_the_same_call() -> None:
    requests = [request([1], 5), request([1], 7), request([1], None), request([1], None), request([1], 5, COLD)]
    call = plan_call(requests)
    assert call.params == [HOT, HOT, HOT, COLD]
    assert call.seeds == [None, 5, 7, 5] and call.counts == [2, 1, 1, 1]
    assert call.members == [[2, 3], [0], [1], [4]]


def sequence_of(req: SampleRequest) -> SampledSequence:
    return SampledSequence(tokens=[req.prompt[0], req.seed or 0], logprobs=[-1.0, -1.0], stop_reason="length")


class Recorder:
    """A fake engine: records each batch; a prompt starting with 0 makes a batch fail."""

    def __init__(self) -> None:
        self.batches: list[int] = []

    def __call__(self, requests: Sequence[SampleRequest]) -> list[SampledSequence]:
        self.batches.append(len(requests))
        if any(req.prompt[0] == 0 for req in requests):
            raise ValueError("prompt 0 is bad")
        return [sequence_of(req) for req in requests]


def wait_until_queued(compute: ComputeThread, count: int) -> None:
    deadline = time.monotonic() + 10
    while compute.queued < count:
        assert time.monotonic() < deadline, f"only {compute.queued} of {count} requests were queued"
        time.sleep(0.001)


def hold(compute: ComputeThread) -> tuple[threading.Event, threading.Thread]:
    """Keep the compute thread busy until the returned event is set."""
    entered, gate = threading.Event(), threading.Event()
    blocker = threading.Thread(target=compute.call, args=(lambda: (entered.set(), gate.wait()),))
    blocker.start()
    assert entered.wait(timeout=10)
    return gate, blocker


def sample_behind_a_gate(compute: ComputeThread, prompts: Sequence[int]) -> list[object]:
    """Hold the thread, queue one request per prompt, release: they run as one batch."""
    gate, blocker = hold(compute)
    results: list[object] = [None] * len(prompts)

    def run(index: int) -> None:
        try:
            results[index] = compute.sample([prompts[index]], HOT, seed=index)
        except ValueError as error:
            results[index] = error

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(prompts))]
    for thread in threads:
        thread.start()
    wait_until_queued(compute, len(prompts))
    gate.set()
    for thread in [blocker, *threads]:
        thread.join(timeout=10)
    return results


def test_queued_requests_run_as_one_batch_and_each_gets_its_own_sample() -> None:
    recorder = Recorder()
    compute = ComputeThread(recorder, linger_s=0.0, linger_max_s=0.0, max_batch_rows=256)
    try:
        results = sample_behind_a_gate(compute, [5, 6, 7, 8])
    finally:
        compute.close()
    assert recorder.batches == [4]
    assert [result.tokens for result in results] == [[5, 0], [6, 1], [7, 2], [8, 3]]  # type: ignore[attr-defined]


def test_batches_are_capped_in_rows() -> None:
    recorder = Recorder()
    compute = ComputeThread(recorder, linger_s=0.0, linger_max_s=0.0, max_batch_rows=3)
    try:
        sample_behind_a_gate(compute, [5, 6, 7, 8, 9])
    finally:
        compute.close()
    assert recorder.batches == [3, 2]


def test_a_bad_request_fails_alone() -> None:
    recorder = Recorder()
    compute = ComputeThread(recorder, linger_s=0.0, linger_max_s=0.0, max_batch_rows=256)
    try:
        results = sample_behind_a_gate(compute, [5, 0, 7])
    finally:
        compute.close()
    assert recorder.batches == [3, 1, 1, 1], "the failed batch is retried request by request"
    assert isinstance(results[1], ValueError)
    assert [result.tokens for result in (results[0], results[2])] == [[5, 0], [7, 2]]  # type: ignore[attr-defined]


def test_calls_return_results_and_raise_errors_on_the_callers_thread() -> None:
    compute = ComputeThread(Recorder(), linger_s=0.0, linger_max_s=0.0, max_batch_rows=8)
    try:
        assert compute.call(threading.current_thread) is not threading.current_thread()
        with pytest.raises(ZeroDivisionError):
            compute.call(lambda: 1 / 0)
    finally:
        compute.close()


def test_close_fails_queued_work_and_stops_the_thread() -> None:
    compute = ComputeThread(Recorder(), linger_s=0.0, linger_max_s=0.0, max_batch_rows=8, name="closing-compute")
    gate, blocker = hold(compute)
    errors: list[BaseException] = []

    def queued() -> None:
        try:
            compute.sample([1], HOT, seed=1)
        except RuntimeError as error:
            errors.append(error)

    waiter = threading.Thread(target=queued)
    waiter.start()
    wait_until_queued(compute, 1)
    closer = threading.Thread(target=compute.close)
    closer.start()
    waiter.join(timeout=10)
    gate.set()
    closer.join(timeout=10)
    blocker.join(timeout=10)
    assert [str(error) for error in errors] == ["the in-process engine was closed"]
    assert not any(thread.name == "closing-compute" for thread in threading.enumerate())
    with pytest.raises(RuntimeError, match="closed"):
        compute.call(lambda: None)
