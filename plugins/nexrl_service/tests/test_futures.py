"""The futures book: recorded before the id is answered, long-polls woken from worker
threads, outcomes read back from the table by a later process."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from nexrl_service.errors import Forbidden, NotFound
from nexrl_service.futures import RESTART_MESSAGE, FutureBook, Outcome
from nexrl_service.store import Store


@pytest.fixture
def book(tmp_path: Path) -> Iterator[FutureBook]:
    book = FutureBook(Store(f"sqlite:///{tmp_path / 'state.db'}"))
    yield book
    book.store.close()


def test_a_long_poll_wakes_when_a_worker_thread_resolves(book: FutureBook) -> None:
    row, is_new = book.create("owner", "lane", 1, "Test")
    assert is_new and book.in_flight == 1

    async def poll() -> Outcome | None:
        timer = threading.Timer(0.05, book.finish, args=(row.request_id, Outcome.json({"ok": True})))
        timer.start()
        try:
            return await book.wait(row.request_id, timeout=10)
        finally:
            timer.join()

    assert asyncio.run(poll()) == Outcome.json({"ok": True})
    assert book.in_flight == 0
    assert book.store.get_future(row.request_id).status == "done"


def test_a_long_poll_times_out_and_close_answers_at_once(book: FutureBook) -> None:
    row, _ = book.create("owner", "lane", None, "Test")
    assert asyncio.run(book.wait(row.request_id, timeout=0.05)) is None
    book.close()
    assert asyncio.run(book.wait(row.request_id, timeout=30)) is None


def test_a_resubmission_gets_the_same_future_and_nothing_new(book: FutureBook) -> None:
    first, is_new = book.create("owner", "lane", 5, "Test", extra={"ids": [1]})
    again, again_new = book.create("owner", "lane", 5, "Test")
    assert is_new and not again_new and again.request_id == first.request_id and again.extra == {"ids": [1]}
    assert book.known("lane", 5).request_id == first.request_id
    assert book.in_flight == 1
    assert book.owner_of(first.request_id) == "owner" and book.owner_of("req-unknown") is None


def test_a_poll_is_answered_only_to_the_key_that_submitted_in_this_process_or_a_later_one(book: FutureBook) -> None:
    row, _ = book.create("alice", "lane", 1, "Test")
    asyncio.run(book.check_owner(row.request_id, "alice", "operation"))
    with pytest.raises(Forbidden, match=f"operation '{row.request_id}' belongs to another API key"):
        asyncio.run(book.check_owner(row.request_id, "bob", "operation"))
    with pytest.raises(NotFound, match="unknown request 'req-never' \\(never submitted"):
        asyncio.run(book.check_owner("req-never", "alice", "request"))
    later = FutureBook(book.store)  # a restarted process knows the owner only from the table
    assert later.owner_in_memory(row.request_id) is None
    asyncio.run(later.check_owner(row.request_id, "alice", "operation"))
    with pytest.raises(Forbidden):
        asyncio.run(later.check_owner(row.request_id, "bob", "operation"))


def test_a_later_process_fails_what_an_earlier_one_left_pending(book: FutureBook) -> None:
    left, _ = book.create("owner", "lane", 1, "Test")
    done, _ = book.create("owner", "lane", 2, "Test")
    book.finish(done.request_id, Outcome.json({"n": 2}))
    later = FutureBook(book.store)  # a restarted server on the same database
    assert later.owner_of(left.request_id) == "owner"
    assert later.recover() == 1
    assert later.peek(left.request_id) == Outcome.failed(RESTART_MESSAGE, "server")
    assert asyncio.run(later.wait(done.request_id, timeout=30)) == Outcome.json({"n": 2})


def test_fetched_results_are_recorded_in_bulk(book: FutureBook) -> None:
    row, _ = book.create("owner", "lane", None, "Test")
    book.finish(row.request_id, Outcome.json({}))
    book.note_fetched(row.request_id)
    assert book.store.get_future(row.request_id).fetched_at is None
    book.flush_fetched()
    assert book.store.get_future(row.request_id).fetched_at is not None


def test_a_batch_records_every_outcome(book: FutureBook) -> None:
    """The outcomes of a batch are written in one transaction, failures included."""
    rows = [book.create("owner", "weights:base", None, "Sample")[0] for _ in range(3)]
    outcomes = [Outcome("done", "application/x-protobuf", b"\x01\x02"), Outcome.failed("bad prompt", "user"), Outcome.json({"a": 1})]
    book.persist_many([(row.request_id, outcome) for row, outcome in zip(rows, outcomes)])
    stored = [book.store.get_future(row.request_id) for row in rows]
    assert [(r.status, r.content_type, r.result, r.error, r.category) for r in stored] == [
        ("done", "application/x-protobuf", b"\x01\x02", None, None),
        ("failed", None, None, "bad prompt", "user"),
        ("done", "application/json", b'{"a": 1}', None, None),
    ]
    assert all(r.finished_at is not None for r in stored)
    fresh = FutureBook(book.store)  # another process: outcomes come from the table
    assert [fresh.peek(row.request_id) for row in rows] == outcomes
