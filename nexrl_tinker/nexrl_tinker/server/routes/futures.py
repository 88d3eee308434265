"""The long-poll on a future: a coroutine, so that a poll holds no thread while it waits."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from nexrl_service.runtime import ServiceState
from nexrl_tinker.server.routes import Owner
from nexrl_tinker.server.schemas import RetrieveFutureBody

__all__ = ["router"]


def router(state: ServiceState, owner: Owner) -> APIRouter:
    routes = APIRouter()

    @routes.post("/api/v1/retrieve_future")
    async def retrieve_future(body: RetrieveFutureBody, who: str = Depends(owner)) -> Response:
        request_id = body.request_id
        await state.book.check_owner(request_id, who, "request")
        outcome = await state.book.wait(request_id, state.settings.long_poll_s)
        if outcome is None:
            return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        state.book.note_fetched(request_id)
        if outcome.status == "failed":
            # The SDK raises this as tinker.RequestFailedError.
            return JSONResponse({"error": outcome.error, "category": outcome.category or "unknown"})
        return Response(outcome.payload, media_type=outcome.content_type)

    return routes
