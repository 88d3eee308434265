"""Sessions: created, read and kept alive; their metrics refused (the run's files hold them)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response

from nexrl_service.runtime import ServiceState
from nexrl_weaver.server.routes import Bodies, Owner
from nexrl_weaver.server.routes.errors import error
from nexrl_weaver.server.routes.schemas import SESSION_BODY, described_body
from nexrl_weaver.server.sessions import WeaverSessions

__all__ = ["router"]


def router(state: ServiceState, sessions: WeaverSessions, bodies: Bodies, owner: Owner) -> APIRouter:
    routes = APIRouter()

    @routes.post("/api/v1/sessions", openapi_extra=described_body(SESSION_BODY, optional=True))
    async def create_session(request: Request, who: str = Depends(owner)) -> dict[str, Any]:
        return await run_in_threadpool(sessions.create, who, await bodies.json(request, optional=True))

    @routes.get("/api/v1/sessions/{session_id}")
    def get_session(session_id: str, who: str = Depends(owner)) -> dict[str, Any]:
        return sessions.get(who, session_id)

    @routes.post("/api/v1/sessions/{session_id}/heartbeat", status_code=204)
    def heartbeat(session_id: str, who: str = Depends(owner)) -> Response:
        sessions.heartbeat(who, session_id)
        return Response(status_code=204)

    @routes.post(
        "/api/v1/sessions/{session_id}/metrics", responses={501: {"description": "not supported here: the run's files hold its metrics"}}
    )
    async def log_metrics(session_id: str, who: str = Depends(owner)) -> JSONResponse:
        """Not kept here (NexRL writes its metrics to the run directory): refused, not dropped."""
        await run_in_threadpool(state.own_session, who, session_id)
        return error(
            501, "log_metrics is not supported by NexRL's local Weaver service; the run's metrics.jsonl and TensorBoard files hold them"
        )

    return routes
