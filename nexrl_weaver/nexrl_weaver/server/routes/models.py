"""A session's training models: created, read and terminated; forward(-backward)
passes, optimizer steps, sampler exports, checkpoints saved, listed and loaded."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool

from nexrl_service.runtime import BadRequest, ServiceState
from nexrl_weaver.server.routes import Bodies, Owner
from nexrl_weaver.server.routes.schemas import ADAM_PARAMS, FORWARD_INPUT, MODEL_BODY, SEQ_ID, STRING, described_body, payload_body
from nexrl_weaver.server.tensors import TensorPack, parse_multipart
from nexrl_weaver.server.training import WeaverTraining

__all__ = ["router"]


async def _forward(training: WeaverTraining, bodies: Bodies, model_id: str, request: Request, who: str, backward: bool) -> dict[str, Any]:
    """A pass's body as JSON, or as ``http-binary`` multipart with its tensor pack."""
    content_type = request.headers.get("content-type", "")
    pack: TensorPack | None = None
    if content_type.startswith("multipart/"):
        limit = bodies.state.settings.max_body_bytes
        raw = await request.body()
        if len(raw) > limit:
            raise BadRequest(f"request body is larger than {limit} bytes")
        body, pack = await run_in_threadpool(parse_multipart, raw, content_type, limit)
    else:
        body = await bodies.json(request)
    return await bodies.submitted(training.forward, who, model_id, body, pack, backward)


def router(state: ServiceState, training: WeaverTraining, bodies: Bodies, owner: Owner) -> APIRouter:
    routes = APIRouter()

    @routes.post("/api/v1/sessions/{session_id}/models", openapi_extra=described_body(MODEL_BODY, required=("base_model",)))
    async def create_model(session_id: str, request: Request, who: str = Depends(owner)) -> dict[str, Any]:
        body = await bodies.json(request)
        answer, request_id = await run_in_threadpool(training.create_model, who, session_id, body)
        if request_id is not None:
            outcome = await state.book.wait(request_id, state.settings.submit_wait_s)
            if outcome is not None and outcome.status == "failed":
                raise BadRequest(f"could not create the model: {outcome.error}")
            if outcome is not None:
                answer["status"] = "ready"
        return answer

    @routes.get("/api/v1/models/{model_id}")
    def get_model(model_id: str, who: str = Depends(owner)) -> dict[str, Any]:
        return training.get_model(who, model_id)

    @routes.post("/api/v1/models/{model_id}/terminate")
    def terminate(model_id: str, who: str = Depends(owner)) -> dict[str, Any]:
        return training.terminate(who, model_id)

    @routes.post("/api/v1/models/{model_id}/forward-passes", openapi_extra=payload_body({"forward_input": FORWARD_INPUT}))
    async def forward(model_id: str, request: Request, who: str = Depends(owner)) -> dict[str, Any]:
        return await _forward(training, bodies, model_id, request, who, False)

    @routes.post("/api/v1/models/{model_id}/forward-backward-passes", openapi_extra=payload_body({"forward_backward_input": FORWARD_INPUT}))
    async def forward_backward(model_id: str, request: Request, who: str = Depends(owner)) -> dict[str, Any]:
        return await _forward(training, bodies, model_id, request, who, True)

    @routes.post("/api/v1/models/{model_id}/optimizer-steps", openapi_extra=payload_body({"adam_params": ADAM_PARAMS}))
    async def optimizer_step(model_id: str, request: Request, who: str = Depends(owner)) -> dict[str, Any]:
        return await bodies.submitted(training.optim_step, who, model_id, await bodies.json(request))

    @routes.post("/api/v1/models/{model_id}/export-sampler", openapi_extra=described_body({"name": STRING, "seq_id": SEQ_ID}))
    async def export_sampler(model_id: str, request: Request, who: str = Depends(owner)) -> dict[str, Any]:
        return await bodies.submitted(training.export_sampler, who, model_id, await bodies.json(request))

    @routes.post("/api/v1/models/{model_id}/checkpoints", openapi_extra=described_body({"name": STRING, "seq_id": SEQ_ID}, optional=True))
    async def save_checkpoint(model_id: str, request: Request, who: str = Depends(owner)) -> dict[str, Any]:
        return await bodies.submitted(training.save_checkpoint, who, model_id, await bodies.json(request, optional=True))

    @routes.get("/api/v1/models/{model_id}/checkpoints")
    def list_checkpoints(model_id: str, who: str = Depends(owner)) -> dict[str, Any]:
        return training.list_checkpoints(who, model_id)

    @routes.post("/api/v1/models/{model_id}/load", openapi_extra=described_body({"checkpoint_id": STRING, "seq_id": SEQ_ID}))
    async def load(model_id: str, request: Request, who: str = Depends(owner)) -> dict[str, Any]:
        return await bodies.submitted(training.load, who, model_id, await bodies.json(request))

    return routes
