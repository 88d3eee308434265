"""One thread for every torch call of an in-process engine, with sample requests batched.

Why one thread: two torch calls running at once on different threads each start an
OpenMP team, and on a machine with few cores the teams fight over them (see
``nexrl_engine/__init__.py``); NexRL's local services run one compute thread for the
same reason. Work runs first in, first out, so sampling requests queued while a
training step runs wait for it and then see whatever weights sampling was given.

Why batching: a GRPO step's rollouts call ``sample_from_prompt`` from up to a hundred
threads at the same moment. Consecutive queued sample requests are drawn together:
`plan_call` makes them one ``Engine.sample`` call, each prompt row with its own
sampling parameters (one decode loop, whatever each request samples with), merges the
requests for one prompt and parameters with consecutive seeds into one prompt row
with a sample count (`nexrl_core.training.coalesce.consecutive_runs`), and passes every row's
seed, so each request gets the tokens it would get alone (sample j of seed s is the
only sample of seed s + j, and a seed's samples do not depend on the batch). While
requests come in bursts, the thread lingers until a burst ends before batching it; a
caller that sends one request at a time never waits.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar, Union

import attrs

from nexrl_core.training.coalesce import consecutive_runs
from nexrl_engine.types import SampledSequence, SamplingParams

__all__ = ["ComputeThread", "EngineCall", "SampleRequest", "plan_call"]

T = TypeVar("T")


@attrs.frozen(eq=False)
class SampleRequest:
    """One sample of one prompt, as a rollout asked for it."""

    prompt: tuple[int, ...]
    params: SamplingParams
    """Everything but the seed (``params.seed`` is None)."""
    seed: int | None
    future: concurrent.futures.Future[SampledSequence] = attrs.field(factory=concurrent.futures.Future)


@attrs.frozen
class EngineCall:
    """One ``Engine.sample`` call serving several requests."""

    params: list[SamplingParams]
    """Per prompt row: how it samples."""
    prompts: list[list[int]]
    seeds: list[int | None]
    """Per prompt row: the seed of its first sample."""
    counts: list[int]
    """Per prompt row: how many samples it draws."""
    members: list[list[int]]
    """Per prompt row: the requests (indices) its samples answer, in sample order."""


def plan_call(requests: Sequence[SampleRequest]) -> EngineCall:
    """One engine call that answers ``requests`` with the samples each would get alone."""
    by_params: dict[SamplingParams, dict[tuple[int, ...], list[int]]] = {}
    for index, request in enumerate(requests):
        by_params.setdefault(request.params, {}).setdefault(request.prompt, []).append(index)
    call = EngineCall([], [], [], [], [])
    for params, by_prompt in by_params.items():
        for prompt, indices in by_prompt.items():
            for run in consecutive_runs([requests[index].seed for index in indices]):
                members = [indices[position] for position in run]
                call.params.append(params)
                call.prompts.append(list(prompt))
                call.seeds.append(requests[members[0]].seed)
                call.counts.append(len(members))
                call.members.append(members)
    return call


@attrs.frozen(eq=False)
class _Call(Generic[T]):
    run: Callable[[], T]
    future: concurrent.futures.Future[T] = attrs.field(factory=concurrent.futures.Future)


_Item = Union[_Call[Any], SampleRequest]


class ComputeThread:
    """Runs calls and batched sample requests on one thread, first in, first out.

    ``sample_many(requests)`` draws one sample per request (in order) on this thread;
    when it fails for a batch, each request is retried alone, so one bad prompt fails
    only its own caller.
    """

    def __init__(
        self,
        sample_many: Callable[[Sequence[SampleRequest]], Sequence[SampledSequence]],
        *,
        linger_s: float,
        linger_max_s: float,
        max_batch_rows: int,
        name: str = "nexrl-inprocess-compute",
    ) -> None:
        self._sample_many = sample_many
        self._linger_s = linger_s
        self._linger_max_s = linger_max_s
        self._max_batch_rows = max_batch_rows
        self._queue: deque[_Item] = deque()
        self._condition = threading.Condition()
        self._closed = False
        self._bursty = False
        """The last sample batch held more than one request."""
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        """Calls and sample requests waiting for the thread (the running one not counted)."""
        with self._condition:
            return len(self._queue)

    @property
    def running(self) -> bool:
        """Whether the thread is still running (`close` stops it)."""
        return self._thread.is_alive()

    def call(self, run: Callable[[], T]) -> T:
        """``run()`` on the compute thread, after everything queued before it; its result or exception."""
        return self.submit(run).result()

    def submit(self, run: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Queue ``run()`` for the compute thread without waiting; a future of its result."""
        job: _Call[T] = _Call(run)
        self._put(job)
        return job.future

    def sample(self, prompt: Sequence[int], params: SamplingParams, seed: int | None) -> SampledSequence:
        """One sample of ``prompt``, drawn with whatever other requests are queued with it."""
        return self.submit_sample(prompt, params, seed).result()

    def submit_sample(self, prompt: Sequence[int], params: SamplingParams, seed: int | None) -> concurrent.futures.Future[SampledSequence]:
        """Queue one sample of ``prompt`` without waiting (a server answering many clients
        from one thread does this); a future of the sample."""
        request = SampleRequest(tuple(prompt), params, seed)
        self._put(request)
        return request.future

    def close(self) -> None:
        """Fail whatever is still queued, let the running job finish, and stop the thread."""
        with self._condition:
            self._closed = True
            pending = list(self._queue)
            self._queue.clear()
            self._condition.notify_all()
        for item in pending:
            item.future.set_exception(RuntimeError("the in-process engine was closed"))
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _put(self, item: _Item) -> None:
        with self._condition:
            if self._closed:
                raise RuntimeError("the in-process engine is closed")
            self._queue.append(item)
            self._condition.notify()

    def _loop(self) -> None:
        while True:
            with self._condition:
                while not self._queue and not self._closed:
                    self._condition.wait()
                if self._closed:
                    return
                head = self._queue[0]
                if isinstance(head, _Call):
                    self._queue.popleft()
            if isinstance(head, _Call):
                _settle(head.future, head.run)
            else:
                self._sample_batch()

    def _sample_batch(self) -> None:
        if self._bursty and self._linger_s > 0:
            self._linger()
        with self._condition:
            batch: list[SampleRequest] = []
            while self._queue and isinstance(self._queue[0], SampleRequest) and len(batch) < self._max_batch_rows:
                batch.append(self._queue.popleft())  # type: ignore[arg-type]
        self._bursty = len(batch) > 1
        if not batch:
            return
        try:
            samples = list(self._sample_many(batch))
        except BaseException as error:  # noqa: BLE001 - a batch is retried request by request
            if len(batch) == 1:
                batch[0].future.set_exception(error)
                return
            for request in batch:
                _settle(request.future, lambda request=request: self._sample_many([request])[0])  # type: ignore[misc]
            return
        for request, sample in zip(batch, samples, strict=True):
            request.future.set_result(sample)

    def _linger(self) -> None:
        """Wait until no request has arrived for ``linger_s`` (at most ``linger_max_s``)."""
        deadline = time.monotonic() + self._linger_max_s
        seen = self.queued
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(self._linger_s, left))
            now = self.queued
            if now == seen:
                return
            seen = now


def _settle(future: concurrent.futures.Future[T], run: Callable[[], T]) -> None:
    try:
        result = run()
    except BaseException as error:  # noqa: BLE001 - the caller waiting on the future re-raises it
        future.set_exception(error)
    else:
        future.set_result(result)
