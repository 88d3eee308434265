"""Session routes' answers: the runtime's `Sessions` in the Tinker SDK's shapes.

A session is what one ``ServiceClient`` opens (ids are UUID4 strings, see `ids`);
the SDK heartbeats every 10 s and stops on a 410.
"""

from __future__ import annotations

from typing import Any

from nexrl_service.sessions import Sessions
from nexrl_service.state import ServiceState
from nexrl_tinker.server.ids import new_session_id
from nexrl_tinker.server.schemas import CreateSessionBody, FinishSessionBody

__all__ = ["SessionService", "str_dict"]


def str_dict(values: dict[str, Any] | None) -> dict[str, str] | None:
    """The SDK types user metadata as ``dict[str, str]``; other values are stringified."""
    if values is None:
        return None
    return {str(k): v if isinstance(v, str) else str(v) for k, v in values.items()}


class SessionService:
    def __init__(self, state: ServiceState) -> None:
        self.state = state
        self.sessions = Sessions(state)

    def create(self, owner: str, body: CreateSessionBody) -> dict[str, Any]:
        session = self.sessions.create(
            owner,
            new_session_id(),
            sdk_version=body.sdk_version,
            tags=body.tags,
            user_metadata=body.user_metadata,
            display_name=body.display_name,
            project_id=body.project_id,
        )
        return {"type": "create_session", "session_id": session.session_id}

    def heartbeat(self, owner: str, session_id: str) -> dict[str, Any]:
        self.sessions.heartbeat(owner, session_id)
        return {"type": "session_heartbeat"}

    def finish(self, owner: str, session_id: str, body: FinishSessionBody | None) -> dict[str, Any]:
        reason = body.reason.type if body is not None and body.reason is not None else None
        self.sessions.finish(owner, session_id, reason)
        return {"status": "finished", "session_id": session_id}

    def list(self, owner: str) -> dict[str, Any]:
        return {"sessions": [s.session_id for s in self.sessions.of_owner(owner)]}

    def get(self, owner: str, session_id: str) -> dict[str, Any]:
        session = self.state.own_session(owner, session_id)
        store = self.state.store
        return {
            "training_run_ids": [m.model_id for m in store.models_of_session(session_id)],
            "sampler_ids": [s.sampler_id for s in store.samplers_of_session(session_id)],
            "user_metadata": str_dict(session.user_metadata),
            "display_name": session.display_name,
        }
