"""Housekeeping: what keeps a long-running service's state from leaking or hanging.

At start-up the janitor fails the futures that a killed process left pending (a client
polling one would otherwise wait forever) and runs one sweep. Afterwards its thread
checks every second for training lanes stuck on a sequence number that never came
and records delivered results, and every ``janitor_interval_s`` sweeps: it expires
sessions without a heartbeat for ``stale_session_s`` (releasing their engines, lanes
and ephemeral samplers), deletes checkpoints past their TTL, and prunes old results.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from nexrl_service.store import SessionRow

if TYPE_CHECKING:
    from nexrl_service.state import ServiceState

__all__ = ["Janitor"]

log = logging.getLogger("nexrl_service")


class Janitor:
    """The recovery at start-up and the periodic sweeps of one `ServiceState`."""

    def __init__(self, state: ServiceState) -> None:
        self.state = state
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        orphaned = self.recover()
        if orphaned:
            log.warning("failed %d request(s) left in flight by a previous server process", orphaned)
        self.sweep()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=f"{self.state.settings.name}-janitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def recover(self) -> int:
        """Fail the futures that an earlier process left pending; returns how many."""
        return self.state.book.recover()

    def _loop(self) -> None:
        last_sweep = time.monotonic()
        while not self._stop.wait(1.0):
            try:
                self.state.scheduler.check_gaps()
                self.state.book.flush_fetched()
                if time.monotonic() - last_sweep >= self.state.settings.janitor_interval_s:
                    last_sweep = time.monotonic()
                    self.sweep()
            except Exception:
                log.exception("housekeeping failed")

    def sweep(self) -> None:
        """Expire stale sessions, delete expired checkpoints, prune old results."""
        state, settings = self.state, self.state.settings
        now = time.time()
        for session in state.store.stale_sessions(now - settings.stale_session_s):
            self.expire_session(session)
        for checkpoint in state.store.expired_checkpoints(now):
            state.forget_checkpoint_files(checkpoint)
            state.store.delete_checkpoint(checkpoint.path)
        state.store.prune_futures(
            fetched_before=now - settings.fetched_retention_s,
            created_before=now - settings.unfetched_retention_s,
        )

    def expire_session(self, session: SessionRow) -> None:
        """Release what a stale session holds: engines, queues, ephemeral samplers.

        Named checkpoints stay (they have their own TTL and can be deleted explicitly),
        as do the training-run records, so saved checkpoint paths keep working.
        """
        state = self.state
        log.info("expiring stale session %s", session.session_id)
        for model in state.store.models_of_session(session.session_id):
            state.release_model(model.model_id)
            state.scheduler.drop(model.model_id)
        doomed = [s for s in state.store.samplers_of_session(session.session_id) if s.ephemeral]
        for sampler in doomed:
            if sampler.weights_dir:
                state.engines.forget_sampler(sampler.weights_dir)
                state.files.remove(sampler.weights_dir)
        state.store.delete_samplers([s.sampler_id for s in doomed])
        state.store.set_session_status(session.session_id, "expired")
