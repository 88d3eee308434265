"""Session routes' answers: the runtime's `Sessions` in the Tinker SDK's shapes.

A session is what one ``ServiceClient`` opens (ids are UUID4 strings, see `ids`);
the SDK heartbeats every 10 s and stops on a 410.
"""

from __future__ import annotations

from typing import Any

from nexrl_service.runtime import BadRequest, Page, ServiceState, Sessions
from nexrl_tinker.server.ids import new_session_id
from nexrl_tinker.server.schemas import CreateSessionBody, FinishSessionBody

__all__ = ["PROJECT_ID_MAX", "SessionService", "str_dict"]

PROJECT_ID_MAX = 256
"""The width of the store's ``project_id`` column."""


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

    def list(self, owner: str, page: Page) -> dict[str, Any]:
        """The caller's session ids, newest first (``ListSessionsResponse`` has no total:
        a page shorter than ``limit`` is the last)."""
        return {"sessions": [s.session_id for s in self.state.store.sessions_page(owner, page.limit, page.offset)]}

    def assign_project(self, owner: str, session_id: str, project_id: object) -> dict[str, Any]:
        """Move a session, and with it its training runs and samplers, into a project.

        Projects are names here (no project has members of its own: one API key is one
        tenant), so any non-empty name is accepted; hosted Tinker's clearing a project is
        not supported there either."""
        self.state.own_session(owner, session_id)
        if not isinstance(project_id, str) or not project_id.strip():
            raise BadRequest("project_id must be a non-empty string: the project to move the session into")
        if len(project_id) > PROJECT_ID_MAX:
            raise BadRequest(f"project_id is {len(project_id)} characters long; at most {PROJECT_ID_MAX} are allowed")
        self.state.store.set_session_project(session_id, project_id)
        return {"session_id": session_id, "project_id": project_id}

    def get(self, owner: str, session_id: str) -> dict[str, Any]:
        session = self.state.own_session(owner, session_id)
        store = self.state.store
        return {
            "training_run_ids": [m.model_id for m in store.models_of_session(session_id)],
            "sampler_ids": [s.sampler_id for s in store.samplers_of_session(session_id)],
            "user_metadata": str_dict(session.user_metadata),
            "display_name": session.display_name,
        }
