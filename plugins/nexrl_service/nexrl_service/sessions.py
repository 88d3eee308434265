"""Sessions: creation, heartbeats, finishing, and the caller's own listing.

A session is what one client opens; its models and samplers are listed under it.
Heartbeats only move ``last_heartbeat``; a session silent for longer than the stale
limit is expired by the `Janitor`. Finishing a session releases its training engines
at once; samplers stay usable, since copies of a sampling client in other processes
may still be sampling from them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from nexrl_service.errors import Gone
from nexrl_service.state import ServiceState
from nexrl_service.store import SessionRow

__all__ = ["Sessions"]


class Sessions:
    """Session operations on the store, with ownership checks."""

    def __init__(self, state: ServiceState) -> None:
        self.state = state

    def create(
        self,
        owner: str,
        session_id: str,
        *,
        sdk_version: str | None = None,
        tags: Sequence[str] = (),
        user_metadata: dict[str, Any] | None = None,
        display_name: str | None = None,
        project_id: str | None = None,
    ) -> SessionRow:
        """Record a new active session under the id the protocol chose."""
        now = time.time()
        row = SessionRow(
            session_id=session_id,
            owner=owner,
            sdk_version=sdk_version,
            tags=list(tags),
            user_metadata=user_metadata,
            display_name=display_name,
            project_id=project_id,
            created_at=now,
            last_heartbeat=now,
            status="active",
        )
        self.state.store.add_session(row)
        return row

    def heartbeat(self, owner: str, session_id: str) -> None:
        """Keep an active session alive; `Gone` once it is finished or expired (clients
        stop heartbeating on that)."""
        session = self.state.own_session(owner, session_id)
        if session.status != "active":
            raise Gone(f"session {session_id!r} is {session.status}")
        self.state.store.touch_session(session_id)

    def finish(self, owner: str, session_id: str, reason: str | None = None) -> None:
        """Mark the session finished and release its training engines (idempotent)."""
        session = self.state.own_session(owner, session_id)
        if session.status == "active":
            self.state.store.finish_session(session_id, reason)
            for model in self.state.store.models_of_session(session_id):
                self.state.release_model(model.model_id)

    def of_owner(self, owner: str) -> list[SessionRow]:
        return self.state.store.sessions_of(owner)
