"""The scheduler: ordered lanes run by seq_id (early jobs wait, refused numbers are
skipped, a number missing past the gap timeout is given up), FIFO lanes batch."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nexrl_service.errors import RequestFailed
from nexrl_service.futures import FutureBook, Outcome
from nexrl_service.scheduler import Job, Scheduler
from nexrl_service.store import Store


@pytest.fixture
def book(tmp_path: Path) -> Iterator[FutureBook]:
    book = FutureBook(Store(f"sqlite:///{tmp_path / 'state.db'}"))
    yield book
    book.store.close()


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


class Recorder:
    """Ordered jobs that append their seq to ``ran``."""

    def __init__(self, book: FutureBook, scheduler: Scheduler, lane: str = "model") -> None:
        self.book, self.scheduler, self.lane = book, scheduler, lane
        self.ran: list[int] = []
        self._lock = threading.Lock()

    def submit(self, seq: int) -> str:
        row, _ = self.book.create("owner", self.lane, seq, "Test")

        def run() -> Outcome:
            with self._lock:
                self.ran.append(seq)
            return Outcome.json({"seq": seq})

        self.scheduler.submit_ordered(self.lane, Job(row.request_id, run, seq=seq))
        return row.request_id


def test_ordered_jobs_run_by_seq_id_whatever_the_arrival_order(book: FutureBook) -> None:
    scheduler = Scheduler(book, threads=2, gap_timeout_s=60)
    try:
        scheduler.open_ordered("model", 1)
        recorder = Recorder(book, scheduler)
        for seq in (4, 3, 2):
            recorder.submit(seq)
        time.sleep(0.05)
        assert recorder.ran == [] and scheduler.expected_seq("model") == 1, "nothing runs while seq 1 is missing"
        last = recorder.submit(1)
        wait_until(lambda: book.peek(last) is not None and len(recorder.ran) == 4)
        assert recorder.ran == [1, 2, 3, 4]
        assert scheduler.expected_seq("model") == 5
    finally:
        scheduler.close()


def test_a_skipped_seq_does_not_block_the_lane(book: FutureBook) -> None:
    scheduler = Scheduler(book, threads=1, gap_timeout_s=60)
    try:
        scheduler.open_ordered("model", 1)
        recorder = Recorder(book, scheduler)
        recorder.submit(3)
        scheduler.skip("model", 2)  # refused before it was queued
        scheduler.skip("model", 1)
        wait_until(lambda: recorder.ran == [3])
    finally:
        scheduler.close()


def test_a_seq_missing_past_the_gap_timeout_is_given_up(book: FutureBook) -> None:
    scheduler = Scheduler(book, threads=1, gap_timeout_s=0.3)
    try:
        scheduler.open_ordered("model", 1)
        recorder = Recorder(book, scheduler)
        recorder.submit(3)
        recorder.submit(2)
        scheduler.check_gaps()
        assert recorder.ran == [], "within the timeout the lane waits"
        time.sleep(0.35)
        scheduler.check_gaps()
        wait_until(lambda: recorder.ran == [2, 3])
        recorder.submit(1)  # arrives after all: run rather than never
        wait_until(lambda: recorder.ran == [2, 3, 1])
    finally:
        scheduler.close()


def test_failures_become_outcomes_with_a_category(book: FutureBook) -> None:
    scheduler = Scheduler(book, threads=1, gap_timeout_s=60)
    failures = {"user": RequestFailed("fix it", "user"), "value": ValueError("bad datum 3"), "bug": KeyError("x")}
    ids = {}
    try:
        for name, exc in failures.items():
            row, _ = book.create("owner", "fifo", None, "Test")

            def run(exc: BaseException = exc) -> Outcome:
                raise exc

            scheduler.submit_fifo("fifo", Job(row.request_id, run))
            ids[name] = row.request_id
        wait_until(lambda: all(book.peek(i) is not None for i in ids.values()))
    finally:
        scheduler.close()
    assert book.peek(ids["user"]) == Outcome.failed("fix it", "user")
    assert book.peek(ids["value"]) == Outcome.failed("bad datum 3", "user")
    bug = book.peek(ids["bug"])
    assert bug.category == "server" and "KeyError" in bug.error


def test_fifo_jobs_with_the_same_key_run_as_one_batch(book: FutureBook) -> None:
    scheduler = Scheduler(book, threads=1, gap_timeout_s=60)
    gate = threading.Event()
    batches: list[list[int]] = []

    def run_batch(jobs) -> list[Outcome]:
        gate.wait(10)
        batches.append([job.payload for job in jobs])
        return [Outcome.json({"n": job.payload}) for job in jobs]

    try:
        ids = []
        for n, key in enumerate(["a", "a", "a", "b", "a"]):
            row, _ = book.create("owner", "fifo", None, "Test")
            job = Job(
                row.request_id,
                lambda n=n: run_batch([Job("", lambda: Outcome.json({}), payload=n)])[0],
                batch_key=key,
                run_batch=run_batch,
                payload=n,
            )
            scheduler.submit_fifo("fifo", job)
            ids.append(row.request_id)
        gate.set()
        wait_until(lambda: all(book.peek(i) is not None for i in ids))
    finally:
        scheduler.close()
    assert batches == [[0], [1, 2], [3], [4]], "the first runs alone; compatible neighbours join; order is kept"
    assert [book.peek(i) for i in ids] == [Outcome.json({"n": n}) for n in range(5)]


@pytest.mark.parametrize(("linger", "expected"), [(0.05, [3]), (0.0, [1, 1, 1])])
def test_a_bursty_lane_lingers_for_the_rest_of_a_burst(book: FutureBook, linger: float, expected: list[int]) -> None:
    """Once sampling has batched, the requests of a later burst that arrive a few ms apart
    run as one batch with a linger, also on a new lane (new weights); without a linger
    each runs as it arrives."""
    scheduler = Scheduler(book, threads=1, gap_timeout_s=60, linger_s=linger, linger_max_s=1.0)
    batches: list[int] = []
    release = threading.Event()
    lock = threading.Lock()

    def run_batch(jobs) -> list[Outcome]:
        release.wait(10)
        with lock:
            batches.append(len(jobs))
        return [Outcome.json({}) for _ in jobs]

    def submit(lane: str) -> None:
        row, _ = book.create("owner", lane, None, "Sample")
        job = Job(row.request_id, lambda: run_batch([None])[0], batch_key="k", run_batch=run_batch)
        scheduler.submit_fifo(lane, job)

    def wait_for(count: int) -> None:
        deadline = time.monotonic() + 10
        while sum(batches) < count and time.monotonic() < deadline:
            time.sleep(0.005)

    try:
        for _ in range(3):  # the first runs alone and holds the lane; two queue behind it
            submit("weights:a")
        release.set()
        wait_for(3)
        assert batches == [1, 2]
        batches.clear()
        for _ in range(3):  # a later burst for new weights, 10 ms apart
            submit("weights:b")
            time.sleep(0.01)
        wait_for(3)
    finally:
        scheduler.close()
    assert batches == expected


def test_an_unnumbered_job_runs_after_every_job_submitted_before_it(book: FutureBook) -> None:
    """``submit_after``: behind seq 2 and 3 (3 waiting for 2), ahead of seq 4 sent later."""
    scheduler = Scheduler(book, threads=2, gap_timeout_s=60)
    try:
        scheduler.open_ordered("model", 1)
        recorder = Recorder(book, scheduler)
        recorder.submit(1)
        recorder.submit(3)
        row, _ = book.create("owner", "model", None, "Save")

        def save() -> Outcome:
            with recorder._lock:
                recorder.ran.append(0)
            return Outcome.json({})

        scheduler.submit_after("model", Job(row.request_id, save))
        recorder.submit(4)
        time.sleep(0.05)
        assert 0 not in recorder.ran, "the unnumbered job jumped ahead of seq 3, which waits for 2"
        recorder.submit(2)
        wait_until(lambda: len(recorder.ran) == 5)
        assert recorder.ran == [1, 2, 3, 0, 4]
    finally:
        scheduler.close()
