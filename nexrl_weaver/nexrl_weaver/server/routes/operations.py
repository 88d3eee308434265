"""The long-poll on an operation, and an ``http-binary`` client's result tensors."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from nexrl_service.runtime import NotFound, ServiceState
from nexrl_weaver.server import operations
from nexrl_weaver.server.routes import Owner

__all__ = ["router"]

NOUN = "operation"
"""What Weaver calls a future, in the refusals of a poll."""


def router(state: ServiceState, owner: Owner) -> APIRouter:
    routes = APIRouter()
    book = state.book

    @routes.get("/api/v1/operations/{operation_id}")
    async def get_operation(operation_id: str, who: str = Depends(owner)) -> dict[str, Any]:
        await book.check_owner(operation_id, who, NOUN)
        outcome = await book.wait(operation_id, state.settings.long_poll_s)
        if outcome is not None:
            book.note_fetched(operation_id)
        return operations.envelope(operation_id, outcome)

    @routes.get("/api/v1/operations/{operation_id}/tensor-pack")
    async def get_tensor_pack(operation_id: str, who: str = Depends(owner)) -> Response:
        await book.check_owner(operation_id, who, NOUN)
        outcome = await run_in_threadpool(book.peek, operation_id)
        if outcome is None:
            raise NotFound(f"operation {operation_id!r} has not finished")
        response, pack = operations.split_result(outcome)
        if pack is None or not isinstance(response, dict):
            raise NotFound(f"operation {operation_id!r} has no tensor pack (its client did not use http-binary)")
        meta = response["tensor_pack"]
        headers = {"X-Weaver-Tensor-Codec": meta["codec"]}
        if meta["codec"] == "zstd":
            headers["X-Weaver-Tensor-Decoded-Size"] = str(meta["decoded_size_bytes"])
        return Response(pack, media_type="application/octet-stream", headers=headers)

    return routes
