"""Sessions: created, kept alive by heartbeats, finished, listed and read."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from nexrl_service.runtime import BadRequest, Page, ServiceState
from nexrl_tinker.server.routes import Owner
from nexrl_tinker.server.schemas import CreateSessionBody, FinishSessionBody, HeartbeatBody
from nexrl_tinker.server.sessions import SessionService

__all__ = ["check_access_scope", "router"]


def check_access_scope(access_scope: str) -> None:
    """``owned`` and ``accessible`` list the same here: one API key is one tenant, with no organization to share with."""
    if access_scope not in ("owned", "accessible"):
        raise BadRequest(f"access_scope must be 'owned' or 'accessible', got {access_scope!r}")


def router(state: ServiceState, sessions: SessionService, owner: Owner) -> APIRouter:
    routes = APIRouter()

    @routes.post("/api/v1/create_session")
    def create_session(body: CreateSessionBody, who: str = Depends(owner)) -> dict[str, Any]:
        return sessions.create(who, body)

    @routes.post("/api/v1/session_heartbeat")
    def session_heartbeat(body: HeartbeatBody, who: str = Depends(owner)) -> dict[str, Any]:
        return sessions.heartbeat(who, body.session_id)

    @routes.post("/api/v1/sessions/{session_id}/finish")
    def finish_session(session_id: str, body: FinishSessionBody | None = None, who: str = Depends(owner)) -> dict[str, Any]:
        return sessions.finish(who, session_id, body)

    @routes.get("/api/v1/sessions")
    def list_sessions(limit: int = 20, offset: int = 0, access_scope: str = "owned", who: str = Depends(owner)) -> dict[str, Any]:
        check_access_scope(access_scope)
        return sessions.list(who, Page.of(limit, offset))

    @routes.post("/api/v1/sessions/search")
    def search_sessions(_owner: str = Depends(owner)) -> dict[str, Any]:
        raise BadRequest(
            "search_sessions is not served here: it searches an organization's sessions across hosted Tinker's "
            "projects; list this API key's sessions with list_sessions(limit, offset) and read each with get_session"
        )

    @routes.get("/api/v1/sessions/{session_id}")
    def get_session(session_id: str, access_scope: str = "owned", who: str = Depends(owner)) -> dict[str, Any]:
        check_access_scope(access_scope)
        return sessions.get(who, session_id)

    @routes.put("/api/v1/sessions/{session_id}/project")
    def assign_session_project(session_id: str, body: dict[str, Any], who: str = Depends(owner)) -> dict[str, Any]:
        return sessions.assign_project(who, session_id, body.get("project_id"))

    @routes.get("/api/v1/sessions/{session_id}/trace_export")
    def export_session_trace(session_id: str, who: str = Depends(owner)) -> dict[str, Any]:
        state.own_session(who, session_id)
        raise BadRequest(
            "export_session_trace is not served here: the Perfetto trace is built from hosted Tinker's request "
            "telemetry, which this service does not record; its own log (nexrl serve tinker) shows each request"
        )

    return routes
