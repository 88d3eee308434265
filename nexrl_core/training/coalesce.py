"""Merge concurrent single-sample requests for one prompt into ``num_samples`` requests.

A GRPO step runs ``group_size`` agents on the same prompt at the same moment, and each
asks the service holder for one completion. Sent one by one, a step of 16 prompts x 8
runs costs 128 round trips through the client SDK, the network and the service; sent as
one request per prompt with ``num_samples=8`` it costs 16, and the service prefills each
prompt once instead of eight times.

The rollout gives the runs of a group consecutive seeds (``s, s+1, ...``), and NexRL's
services draw sample j of a seed-``s`` request exactly as the only sample of a seed-``s+j``
request. So `SampleCoalescer` only merges requests whose options are equal but for the
seed and whose seeds are consecutive: with those services every run gets the sample it
would have got alone, whatever the thread timing, and a resumed run stays reproducible.
Requests without a seed merge freely. Against a service without that seed rule (hosted
Tinker) merged samples are still independent draws from the same distribution.

A request waits up to a short quiet period (``window_s``) for the rest of its group; the
first request of a batch is its leader and sends it from its own thread.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import attrs

from nexrl_core.chat.model import SamplingOptions

__all__ = ["SampleCoalescer", "consecutive_runs"]

T = TypeVar("T")

SendMany = Callable[[list[int], SamplingOptions, int], Sequence[T]]
"""``send(prompt, options, n)``: ``n`` samples of ``prompt``; ``options.seed`` is the first
sample's seed. Returns them in order."""

_MAX_WAITS = 10
"""A batch still growing after this many quiet periods is sent anyway."""


@attrs.define
class _Pending(Generic[T]):
    prompt: list[int]
    options: SamplingOptions
    """Options of the first request, seed included (the others differ only in the seed)."""
    members: list[tuple[int | None, concurrent.futures.Future[T]]] = attrs.field(factory=list)


def _key(prompt: Sequence[int], options: SamplingOptions) -> tuple[object, ...]:
    stop = tuple(options.stop) if options.stop is not None else None
    return (tuple(prompt), options.max_tokens, options.temperature, options.top_p, options.top_k, stop)


def consecutive_runs(seeds: Sequence[int | None]) -> list[list[int]]:
    """Indices of ``seeds`` grouped into requests: runs of consecutive seeds (in seed
    order), and all the ``None`` seeds together."""
    unseeded = [index for index, seed in enumerate(seeds) if seed is None]
    seeded = sorted((seed, index) for index, seed in enumerate(seeds) if seed is not None)
    runs: list[list[int]] = [unseeded] if unseeded else []
    previous: int | None = None
    for seed, index in seeded:
        if previous is not None and seed == previous + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
        previous = seed
    return runs


class SampleCoalescer(Generic[T]):
    """Sends concurrent `sample` calls with the same prompt and options as few requests.

    ``window_s`` is the quiet period a batch waits for more members (0 sends every call
    alone, at once).
    """

    def __init__(self, send: SendMany[T], window_s: float) -> None:
        self._send = send
        self._window_s = window_s
        self._lock = threading.Lock()
        self._pending: dict[tuple[object, ...], _Pending[T]] = {}

    def sample(self, prompt: Sequence[int], options: SamplingOptions) -> T:
        """One sample of ``prompt``, sent with whatever else arrives for it meanwhile."""
        prompt = list(prompt)
        if self._window_s <= 0:
            return self._send(prompt, options, 1)[0]
        key = _key(prompt, options)
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            pending = self._pending.get(key)
            leader = pending is None
            if pending is None:
                pending = self._pending[key] = _Pending(prompt, options)
            pending.members.append((options.seed, future))
        if leader:
            self._lead(key, pending)
        return future.result()

    def _lead(self, key: tuple[object, ...], pending: _Pending[T]) -> None:
        size = 1
        for _ in range(_MAX_WAITS):
            time.sleep(self._window_s)
            with self._lock:
                if len(pending.members) == size:
                    break
                size = len(pending.members)
        with self._lock:
            del self._pending[key]
        members = pending.members
        for run in consecutive_runs([seed for seed, _ in members]):
            futures = [members[index][1] for index in run]
            options = attrs.evolve(pending.options, seed=members[run[0]][0])
            try:
                samples = self._send(pending.prompt, options, len(run))
                if len(samples) != len(run):
                    raise RuntimeError(f"asked the service for {len(run)} samples and got {len(samples)}")
            except BaseException as error:  # every waiting run must hear about it
                for future in futures:
                    future.set_exception(error)
                continue
            for future, sample in zip(futures, samples):
                future.set_result(sample)
