"""Runs accepted requests on worker threads, one at a time per lane.

A *lane* is a training model or a sampling engine. Training lanes are ordered: a
client numbers its requests to one model (``seq_id``), may post the chunks of one
``forward_backward`` concurrently with the first chunk last, and expects them applied
strictly in order. So a training lane keeps ``next_seq`` and runs a job only when its
number comes up; a job that arrives early waits for the missing ones. A number that
never arrives (a client that died between reserving and sending it) would block the
lane forever, so after ``gap_timeout_s`` the lane skips ahead and logs it. A protocol may also send
requests without a number to an ordered lane (Weaver numbers its training steps but
not its checkpoint saves and loads): `Scheduler.submit_after` runs such a job once
every job submitted before it has run, and before any numbered job after it.

Sampling lanes are first-in first-out, and consecutive compatible jobs (the same
``batch_key``: for samples, whether prompt logprobs are wanted and whether prompt
positions are scored; each request keeps its own sampling parameters in the batch) run as one batched engine call of at most `MAX_BATCH_ROWS` sampled rows. While sampling is bursty (the last
batchable batch held several jobs), an idle lane that receives a batchable job lingers
until requests stop arriving for ``linger_s`` (at most ``linger_max_s``) before it forms
the batch. An RL step's requests reach the server over tens of milliseconds, and without
the wait the first would run alone and the rest queue behind it; a client that sends one
request at a time never waits. Burstiness belongs to the scheduler, not to a lane: every
weight update opens a new sampling lane, and an emptied FIFO lane is dropped.

Compute runs on a thread pool, never on the event loop, so heartbeats and long-polls
stay responsive while a model trains.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs

from nexrl_service.errors import RequestFailed
from nexrl_service.futures import FutureBook, Outcome

__all__ = ["MAX_BATCH_ROWS", "Job", "Scheduler", "failure_outcome"]

log = logging.getLogger("nexrl_service")

MAX_BATCH_ROWS = 256
"""Most rows (prompts x samples) one batched sampling call takes; a single larger
request still runs, alone."""


@attrs.define
class Job:
    """One accepted request's work, run on a lane when its turn comes."""

    request_id: str
    run: Callable[[], Outcome]
    seq: int | None = None
    batch_key: Any = None
    """Jobs of one FIFO lane with the same non-None key may run together through ``run_batch``."""
    run_batch: Callable[[Sequence[Job]], Sequence[Outcome]] | None = None
    payload: Any = None
    """What ``run_batch`` needs from each job of a batch."""
    rows: int = 1
    """How much of a batch the job takes (sampled rows), against `MAX_BATCH_ROWS`."""


@attrs.define
class _Lane:
    ordered: bool
    next_seq: int = 0
    waiting: dict[int, Job] = attrs.field(factory=dict)
    queue: deque = attrs.field(factory=deque)
    after: deque = attrs.field(factory=deque)
    """Unnumbered jobs of an ordered lane: ``(barrier, job)``, run once ``next_seq`` has
    passed ``barrier``, the highest number submitted before the job."""
    busy: bool = False
    blocked_since: float | None = None


def failure_outcome(exc: BaseException) -> Outcome:
    """The outcome of a job that raised: a user error for `RequestFailed` and the
    engine's input checks, else a server error that is logged with its traceback."""
    if isinstance(exc, RequestFailed):
        return Outcome.failed(exc.message, exc.category)
    if isinstance(exc, ValueError):
        # The engine validates its inputs with ValueError and names the culprit.
        return Outcome.failed(str(exc), "user")
    log.exception("request failed with an internal error", exc_info=exc)
    return Outcome.failed(f"internal server error: {type(exc).__name__}: {exc}", "server")


class Scheduler:
    """Lanes of jobs run on a small thread pool; outcomes go to the `FutureBook`."""

    def __init__(
        self,
        book: FutureBook,
        threads: int,
        gap_timeout_s: float,
        linger_s: float = 0.0,
        linger_max_s: float = 0.0,
        thread_name: str = "runtime-compute",
    ) -> None:
        self.book = book
        self.gap_timeout_s = gap_timeout_s
        self.linger_s = linger_s
        self.linger_max_s = linger_max_s
        self._executor = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix=thread_name)
        self._lock = threading.Lock()
        self._lanes: dict[str, _Lane] = {}
        self._bursty = False
        """The last batchable batch held more than one job."""
        self._closed = False

    # --- lanes ------------------------------------------------------------------------------

    def has_lane(self, lane_id: str) -> bool:
        with self._lock:
            return lane_id in self._lanes

    def open_ordered(self, lane_id: str, next_seq: int) -> None:
        """Create an ordered lane expecting ``next_seq`` (no-op if it exists)."""
        with self._lock:
            self._lanes.setdefault(lane_id, _Lane(ordered=True, next_seq=next_seq))

    def drop(self, lane_id: str) -> None:
        with self._lock:
            self._lanes.pop(lane_id, None)

    def expected_seq(self, lane_id: str) -> int | None:
        with self._lock:
            lane = self._lanes.get(lane_id)
            return lane.next_seq if lane is not None else None

    # --- submission ---------------------------------------------------------------------------

    def submit_ordered(self, lane_id: str, job: Job) -> None:
        assert job.seq is not None
        with self._lock:
            lane = self._lanes.get(lane_id)
            if lane is None:
                raise RuntimeError(f"lane {lane_id!r} was not opened")
            if job.seq < lane.next_seq:
                # Already passed (skipped after a gap): run it now rather than never.
                log.warning("lane %s: seq_id %s arrived after the lane moved on to %s", lane_id, job.seq, lane.next_seq)
                lane.queue.append(job)
            else:
                lane.waiting[job.seq] = job
            self._pump(lane_id, lane)

    def submit_after(self, lane_id: str, job: Job) -> None:
        """Queue an unnumbered job on an ordered lane, behind every job submitted so far."""
        with self._lock:
            lane = self._lanes.get(lane_id)
            if lane is None or not lane.ordered:
                raise RuntimeError(f"ordered lane {lane_id!r} was not opened")
            barrier = max([lane.next_seq - 1, *lane.waiting])
            lane.after.append((barrier, job))
            self._pump(lane_id, lane)

    def skip(self, lane_id: str, seq: int) -> None:
        """Mark ``seq`` as consumed without running anything (a refused submission)."""
        with self._lock:
            lane = self._lanes.get(lane_id)
            if lane is None or seq < lane.next_seq:
                return
            if seq == lane.next_seq and not lane.busy:
                lane.next_seq += 1
            else:
                lane.waiting[seq] = Job(request_id="", run=lambda: Outcome.json({}), seq=seq)
            self._pump(lane_id, lane)

    def submit_fifo(self, lane_id: str, job: Job) -> None:
        with self._lock:
            lane = self._lanes.setdefault(lane_id, _Lane(ordered=False))
            lane.queue.append(job)
            self._pump(lane_id, lane)

    # --- execution ------------------------------------------------------------------------------

    def _pump(self, lane_id: str, lane: _Lane) -> None:
        """Start the lane's next runnable job(s) if it is idle. Caller holds the lock."""
        if lane.busy or self._closed:
            return
        if lane.queue:
            lane.busy = True
            first = lane.queue[0]
            if self._bursty and self.linger_s > 0 and first.batch_key is not None and first.run_batch is not None:
                # Waiting happens on its own thread, so the compute threads stay free for other lanes.
                threading.Thread(target=self._linger_then_run, args=(lane_id, lane), daemon=True).start()
            else:
                self._executor.submit(self._run, lane_id, lane, self._take_batch(lane))
            return
        if lane.ordered:
            if lane.after and lane.after[0][0] < lane.next_seq:
                lane.busy = True
                self._executor.submit(self._run, lane_id, lane, [lane.after.popleft()[1]])
                return
            while lane.next_seq in lane.waiting and not lane.waiting[lane.next_seq].request_id:
                del lane.waiting[lane.next_seq]  # a skipped placeholder
                lane.next_seq += 1
            job = lane.waiting.pop(lane.next_seq, None)
            if job is None:
                lane.blocked_since = (lane.blocked_since or time.monotonic()) if lane.waiting else None
                return
            lane.blocked_since = None
            lane.busy = True
            self._executor.submit(self._run, lane_id, lane, [job])

    def _take_batch(self, lane: _Lane) -> list[Job]:
        """The first queued job and the compatible ones right behind it. Caller holds the lock."""
        batch = [lane.queue.popleft()]
        key = batch[0].batch_key
        if key is not None and batch[0].run_batch is not None:
            rows = batch[0].rows
            while lane.queue and lane.queue[0].batch_key == key and rows + lane.queue[0].rows <= MAX_BATCH_ROWS:
                rows += lane.queue[0].rows
                batch.append(lane.queue.popleft())
            self._bursty = len(batch) > 1
        return batch

    def _linger_then_run(self, lane_id: str, lane: _Lane) -> None:
        """Wait for the burst a batchable job belongs to, then run it as one batch."""
        deadline = time.monotonic() + self.linger_max_s
        with self._lock:
            seen = len(lane.queue)
        while time.monotonic() < deadline:
            time.sleep(min(self.linger_s, max(0.0, deadline - time.monotonic())))
            with self._lock:
                if len(lane.queue) == seen:
                    break
                seen = len(lane.queue)
        with self._lock:
            batch = self._take_batch(lane)
            if self._closed:
                lane.busy = False
                return
            self._executor.submit(self._run, lane_id, lane, batch)

    def _run(self, lane_id: str, lane: _Lane, batch: list[Job]) -> None:
        outcomes: list[Outcome] = []
        try:
            if len(batch) > 1:
                try:
                    outcomes = list(batch[0].run_batch(batch))  # type: ignore[misc]
                except BaseException as exc:  # noqa: BLE001 - every job gets the failure
                    outcomes = [failure_outcome(exc)] * len(batch)
            else:
                try:
                    outcomes = [batch[0].run()]
                except BaseException as exc:  # noqa: BLE001
                    outcomes = [failure_outcome(exc)]
            for job, outcome in zip(batch, outcomes):
                self.book.resolve(job.request_id, outcome)
        finally:
            # Start the lane's next job before writing results to SQL: the write is off
            # the critical path of a pipelined forward_backward + optim_step.
            with self._lock:
                lane.busy = False
                if lane.ordered and len(batch) == 1 and batch[0].seq is not None and batch[0].seq >= lane.next_seq:
                    lane.next_seq = batch[0].seq + 1
                self._pump(lane_id, lane)
                if not lane.ordered and not lane.busy and not lane.queue and self._lanes.get(lane_id) is lane:
                    del self._lanes[lane_id]  # FIFO lanes hold no state; one opens per sampler weights
        try:
            self.book.persist_many([(job.request_id, outcome) for job, outcome in zip(batch, outcomes)])
        except Exception:
            log.exception("could not record the outcomes of %s", ", ".join(job.request_id for job in batch))

    def check_gaps(self) -> None:
        """Skip sequence numbers that have been missing longer than the gap timeout."""
        now = time.monotonic()
        with self._lock:
            for lane_id, lane in self._lanes.items():
                if lane.busy or not lane.waiting or lane.blocked_since is None:
                    continue
                if now - lane.blocked_since >= self.gap_timeout_s:
                    first = min(lane.waiting)
                    log.warning(
                        "lane %s: seq_id %s never arrived within %.0f s; continuing at %s",
                        lane_id,
                        lane.next_seq,
                        self.gap_timeout_s,
                        first,
                    )
                    lane.next_seq = first
                    lane.blocked_since = None
                    self._pump(lane_id, lane)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._executor.shutdown(wait=True, cancel_futures=True)
