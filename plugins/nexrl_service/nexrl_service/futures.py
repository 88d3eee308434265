"""Futures: the record of every accepted request and the long-poll that waits on it.

A future (an "operation" in protocols that call it so) is written to the ``futures``
table before its request id goes back to the client, so it survives a crash as a row;
a row still pending from a previous server process is failed at start-up with a
message that says the server restarted (the client reports that failure instead of
polling forever).

Results live in the table too (whatever bytes the protocol encoded, with their
content type) and in a small in-memory map for the fast path. ``wait`` is called on the event loop; completion happens on
worker threads and wakes the waiters with ``call_soon_threadsafe``, so a long-poll
costs no thread while it waits.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import attrs
from fastapi.concurrency import run_in_threadpool

from nexrl_service.errors import Forbidden, NotFound
from nexrl_service.store import FutureRow, Store

__all__ = ["JSON_CONTENT_TYPE", "RESTART_MESSAGE", "FutureBook", "Outcome", "new_request_id"]

JSON_CONTENT_TYPE = "application/json"
RESTART_MESSAGE = (
    "the server restarted while this request was in flight, so it never completed; "
    "state saved before the restart is intact: resubmit the request (or reload the last checkpoint)"
)


def new_request_id() -> str:
    """An opaque, unique request id."""
    return f"req-{uuid.uuid4().hex}"


@attrs.frozen
class Outcome:
    """A finished future: the encoded result, or the failure the protocol reports."""

    status: str
    """``done`` or ``failed``."""
    content_type: str = JSON_CONTENT_TYPE
    payload: bytes = b""
    error: str | None = None
    category: str | None = None

    @classmethod
    def json(cls, value: Any) -> Outcome:
        return cls("done", JSON_CONTENT_TYPE, json.dumps(value).encode("utf-8"))

    @classmethod
    def failed(cls, message: str, category: str = "user") -> Outcome:
        return cls("failed", JSON_CONTENT_TYPE, b"", message, category)


class FutureBook:
    """Accepted requests: recorded in SQL, resolved from worker threads, awaited by long-polls."""

    def __init__(self, store: Store, memory_results: int = 2048) -> None:
        self.store = store
        self.epoch = uuid.uuid4().hex
        """This process's identity, stored with each future it accepts."""
        self._lock = threading.Lock()
        self._recent: OrderedDict[str, Outcome] = OrderedDict()
        self._memory_results = memory_results
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}
        self._pending: set[str] = set()
        """Futures accepted by this process and not finished: waiting on them needs no SQL."""
        self._owners: OrderedDict[str, str] = OrderedDict()
        self._by_seq: OrderedDict[tuple[str, int], FutureRow] = OrderedDict()
        self._fetched: set[str] = set()
        self._closing = False

    @property
    def in_flight(self) -> int:
        """Futures accepted by this process and not finished yet."""
        with self._lock:
            return len(self._pending)

    def known(self, lane: str, seq_id: int | None) -> FutureRow | None:
        """The future this process accepted for ``(lane, seq_id)``, if any (no SQL)."""
        if seq_id is None:
            return None
        with self._lock:
            return self._by_seq.get((lane, seq_id))

    def owner_in_memory(self, request_id: str) -> str | None:
        """Who submitted ``request_id``, if this process remembers (no SQL)."""
        with self._lock:
            return self._owners.get(request_id)

    def owner_of(self, request_id: str) -> str | None:
        """Who submitted ``request_id``, or None for an unknown id."""
        owner = self.owner_in_memory(request_id)
        if owner is not None:
            return owner
        row = self.store.get_future(request_id)
        return row.owner if row is not None else None

    async def check_owner(self, request_id: str, who: str, noun: str) -> None:
        """Refuse a poll of a future ``who`` did not submit: `NotFound` for an id never
        seen (or expired), `Forbidden` for another key's. ``noun`` is what the protocol
        calls a future ("request", "operation"). Awaited by the long-poll routes: the
        in-memory answer needs no SQL, and the table is read off the event loop."""
        submitter = self.owner_in_memory(request_id)
        if submitter is None:
            submitter = await run_in_threadpool(self.owner_of, request_id)
        if submitter is None:
            raise NotFound(f"unknown {noun} {request_id!r} (never submitted, or its result expired)")
        if submitter != who:
            raise Forbidden(f"{noun} {request_id!r} belongs to another API key")

    def recover(self) -> int:
        """Fail the futures that an earlier process left pending; returns how many."""
        return self.store.fail_orphaned_futures(self.epoch, RESTART_MESSAGE)

    def create(
        self,
        owner: str,
        lane: str,
        seq_id: int | None,
        kind: str,
        extra: dict[str, Any] | None = None,
        request_id: str | None = None,
    ) -> tuple[FutureRow, bool]:
        """Record a submission; ``(row, False)`` when ``(lane, seq_id)`` was already
        submitted (the same future is answered again and nothing runs twice)."""
        row = FutureRow(
            request_id=request_id or new_request_id(),
            owner=owner,
            lane=lane,
            seq_id=seq_id,
            kind=kind,
            status="pending",
            epoch=self.epoch,
            created_at=time.time(),
            extra=extra,
        )
        stored = self.store.add_future(row)
        is_new = stored.request_id == row.request_id
        with self._lock:
            if is_new:
                self._pending.add(stored.request_id)
            self._owners[stored.request_id] = stored.owner
            while len(self._owners) > 100_000:
                self._owners.popitem(last=False)
            if seq_id is not None:
                self._by_seq[(lane, seq_id)] = stored
                while len(self._by_seq) > 100_000:
                    self._by_seq.popitem(last=False)
        return stored, is_new

    def finish(self, request_id: str, outcome: Outcome) -> None:
        """Store the outcome and wake whoever long-polls it (any thread)."""
        self.resolve(request_id, outcome)
        self.persist(request_id, outcome)

    def resolve(self, request_id: str, outcome: Outcome) -> None:
        """Make the outcome visible and wake the long-polls; no SQL, so it is quick."""
        with self._lock:
            self._recent[request_id] = outcome
            while len(self._recent) > self._memory_results:
                self._recent.popitem(last=False)
            self._pending.discard(request_id)
            waiters = self._waiters.pop(request_id, [])
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # loop already closed (shutdown)
                pass

    def persist(self, request_id: str, outcome: Outcome) -> None:
        """Write the outcome to the table (it outlives the in-memory copy and the process)."""
        self.persist_many([(request_id, outcome)])

    def persist_many(self, finished: Sequence[tuple[str, Outcome]]) -> None:
        """`persist` for several futures in one transaction (the requests of a batch)."""
        self.store.finish_futures(
            [
                (request_id, None, None, outcome.error, outcome.category)
                if outcome.status == "failed"
                else (request_id, outcome.content_type, outcome.payload, None, None)
                for request_id, outcome in finished
            ]
        )

    def close(self) -> None:
        """Wake every long-poll (they answer try_again) and make new ones return at once."""
        with self._lock:
            self._closing = True
            waiters = [w for ws in self._waiters.values() for w in ws]
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:
                pass

    def note_fetched(self, request_id: str) -> None:
        """Remember that a result was delivered; written to the table by `flush_fetched`."""
        with self._lock:
            self._fetched.add(request_id)

    def flush_fetched(self) -> None:
        with self._lock:
            fetched, self._fetched = list(self._fetched), set()
        self.store.mark_fetched(fetched, time.time())

    def peek(self, request_id: str) -> Outcome | None:
        with self._lock:
            outcome = self._recent.get(request_id)
        if outcome is not None:
            return outcome
        row = self.store.get_future(request_id)
        if row is None or row.status == "pending":
            return None
        return self._outcome_of(row)

    @staticmethod
    def _outcome_of(row: FutureRow) -> Outcome:
        if row.status == "failed":
            return Outcome.failed(row.error or "request failed", row.category or "unknown")
        return Outcome("done", row.content_type or JSON_CONTENT_TYPE, row.result or b"")

    async def wait(self, request_id: str, timeout: float) -> Outcome | None:
        """The outcome, waiting up to ``timeout`` seconds; None if still pending."""
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        with self._lock:
            outcome = self._recent.get(request_id)
            local = request_id in self._pending
            if outcome is None:
                self._waiters.setdefault(request_id, []).append((loop, event))
        if outcome is not None:
            return outcome
        try:
            if not local:
                # Finished long ago, or accepted by an earlier process: the table knows.
                row = await asyncio.to_thread(self.store.get_future, request_id)
                if row is None or row.status != "pending":
                    return self._outcome_of(row) if row is not None else None
            if self._closing:
                return None
            try:
                await asyncio.wait_for(event.wait(), timeout)
            except asyncio.TimeoutError:
                return None
            return self.peek(request_id)
        finally:
            with self._lock:
                waiters = self._waiters.get(request_id)
                if waiters is not None:
                    waiters[:] = [w for w in waiters if w[1] is not event]
                    if not waiters:
                        del self._waiters[request_id]
