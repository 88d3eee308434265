"""Session routes' answers: the runtime's `Sessions` in the nex-weaver SDK's shapes.

A session is what one ``ServiceClient.connect()`` opens (ids are UUIDs); the SDK
heartbeats every 30 s and ignores the answer. A ``scheduling_policy`` sent at
creation must come back unchanged, or the SDK refuses the session.
"""

from __future__ import annotations

from typing import Any

from nexrl_service.runtime import BadRequest, ServiceState, SessionRow, Sessions
from nexrl_weaver.server.bodies import obj, optional_str
from nexrl_weaver.server.ids import new_id

__all__ = ["WeaverSessions"]


class WeaverSessions:
    def __init__(self, state: ServiceState) -> None:
        self.state = state
        self.sessions = Sessions(state)

    @staticmethod
    def session_json(session: SessionRow) -> dict[str, Any]:
        metadata = dict(session.user_metadata or {})
        answer = {
            "id": session.session_id,
            "status": session.status,
            "tags": list(session.tags or []),
            "name": session.display_name,
            "project_id": session.project_id,
            "user_metadata": metadata.get("user_metadata"),
            "labels": metadata.get("labels"),
            "sdk_version": session.sdk_version,
        }
        if metadata.get("scheduling_policy") is not None:
            answer["scheduling_policy"] = metadata["scheduling_policy"]
        return answer

    def create(self, owner: str, body: dict[str, Any]) -> dict[str, Any]:
        tags = body.get("tags") or []
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            raise BadRequest("body.tags must be a list of strings")
        kept = {
            "user_metadata": obj(body.get("user_metadata"), "body.user_metadata") or None,
            "labels": obj(body.get("labels"), "body.labels") or None,
            "scheduling_policy": obj(body.get("scheduling_policy"), "body.scheduling_policy") or None,
        }
        session = self.sessions.create(
            owner,
            new_id(),
            sdk_version=optional_str(body, "sdk_version"),
            tags=tags,
            user_metadata=kept,
            display_name=optional_str(body, "name"),
            project_id=optional_str(body, "project_id"),
        )
        return self.session_json(session)

    def get(self, owner: str, session_id: str) -> dict[str, Any]:
        return self.session_json(self.state.own_session(owner, session_id))

    def heartbeat(self, owner: str, session_id: str) -> None:
        self.sessions.heartbeat(owner, session_id)
