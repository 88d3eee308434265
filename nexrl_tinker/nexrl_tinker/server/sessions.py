"""Sessions: creation, heartbeats, finishing, and the caller's own listing.

A session is what one ``ServiceClient`` opens; its models and samplers are listed
under it. Heartbeats (every 10 s from the SDK) only move ``last_heartbeat``; a session
silent for longer than the stale limit is expired by the janitor (see `Cloud`).
Finishing a session (``ServiceClient.close()``) releases its training engines at
once; samplers stay usable, since copies of a SamplingClient in other processes
may still be sampling from them.
"""

from __future__ import annotations

import time
from typing import Any

from nexrl_tinker.server.cloud import Cloud
from nexrl_tinker.server.errors import Gone
from nexrl_tinker.server.ids import new_session_id
from nexrl_tinker.server.schemas import CreateSessionBody, FinishSessionBody
from nexrl_tinker.server.store import SessionRow

__all__ = ["SessionService"]


class SessionService:
    def __init__(self, cloud: Cloud) -> None:
        self.cloud = cloud

    def create(self, owner: str, body: CreateSessionBody) -> dict[str, Any]:
        now = time.time()
        session_id = new_session_id()
        self.cloud.store.add_session(
            SessionRow(
                session_id=session_id,
                owner=owner,
                sdk_version=body.sdk_version,
                tags=list(body.tags),
                user_metadata=body.user_metadata,
                display_name=body.display_name,
                project_id=body.project_id,
                created_at=now,
                last_heartbeat=now,
                status="active",
            )
        )
        return {"type": "create_session", "session_id": session_id}

    def heartbeat(self, owner: str, session_id: str) -> dict[str, Any]:
        session = self.cloud.own_session(owner, session_id)
        if session.status != "active":
            raise Gone(f"session {session_id!r} is {session.status}")
        self.cloud.store.touch_session(session_id)
        return {"type": "session_heartbeat"}

    def finish(self, owner: str, session_id: str, body: FinishSessionBody | None) -> dict[str, Any]:
        session = self.cloud.own_session(owner, session_id)
        if session.status == "active":
            reason = body.reason.type if body is not None and body.reason is not None else None
            self.cloud.store.finish_session(session_id, reason)
            for model in self.cloud.store.models_of_session(session_id):
                self.cloud.engines.release_training(model.model_id)
        return {"status": "finished", "session_id": session_id}

    def list(self, owner: str) -> dict[str, Any]:
        return {"sessions": [s.session_id for s in self.cloud.store.sessions_of(owner)]}

    def get(self, owner: str, session_id: str) -> dict[str, Any]:
        session = self.cloud.own_session(owner, session_id)
        return {
            "training_run_ids": [m.model_id for m in self.cloud.store.models_of_session(session_id)],
            "sampler_ids": [s.sampler_id for s in self.cloud.store.samplers_of_session(session_id)],
            "user_metadata": _str_dict(session.user_metadata),
            "display_name": session.display_name,
        }


def _str_dict(values: dict[str, Any] | None) -> dict[str, str] | None:
    """The SDK types user metadata as ``dict[str, str]``; other values are stringified."""
    if values is None:
        return None
    return {str(k): v if isinstance(v, str) else str(v) for k, v in values.items()}
