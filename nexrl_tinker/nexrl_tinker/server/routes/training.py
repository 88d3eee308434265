"""Training: models created and read, forward(-backward) passes, optimizer steps, and
weights saved and loaded."""

from __future__ import annotations

import json
from typing import Any

import attrs
from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool

from nexrl_core.http.openapi import json_body
from nexrl_service.runtime import BadRequest
from nexrl_tinker.server.codec import (
    FORWARD_BACKWARD_JSON,
    FwdBwdRequest,
    decode_forward_backward,
    decode_forward_backward_json,
    decompress_body,
    forward_backward_ids,
)
from nexrl_tinker.server.routes import Owner
from nexrl_tinker.server.schemas import (
    CreateModelBody,
    LoadWeightsBody,
    ModelIdBody,
    OptimStepBody,
    SaveWeightsBody,
    SaveWeightsExternalBody,
    SaveWeightsForSamplerBody,
)
from nexrl_tinker.server.training import TrainingService

__all__ = ["router"]

FORWARD_BACKWARD_BODY = json_body(FORWARD_BACKWARD_JSON, required=("model_id",))
"""The JSON body's schema; the same request may come in the SDK's binary encoding
(application/octet-stream), which the handler reads by hand."""


async def _forward_backward(training: TrainingService, max_body: int, request: Request, who: str, forward_only: bool) -> dict[str, Any]:
    raw = await request.body()
    if len(raw) > max_body:
        raise BadRequest(f"request body is larger than {max_body} bytes")
    content_type = request.headers.get("content-type", "")
    encoding = request.headers.get("content-encoding")

    def decode(data: bytes) -> FwdBwdRequest:
        if "json" in content_type:
            try:
                parsed = json.loads(data)
            except (ValueError, UnicodeDecodeError) as exc:
                raise BadRequest(f"malformed JSON body: {exc}") from None
            return decode_forward_backward_json(parsed, forward_only)
        fb_request = decode_forward_backward(data)
        return attrs.evolve(fb_request, forward_only=True) if forward_only and not fb_request.forward_only else fb_request

    def submit() -> dict[str, Any]:
        data = decompress_body(raw, encoding, max_body)
        try:
            fb_request = decode(data)
        except BadRequest:
            ids = forward_backward_ids(data, content_type)
            if ids is not None:
                training.ops.consume_refused(who, *ids)
            raise
        return training.forward_backward(who, fb_request)

    return await run_in_threadpool(submit)


def router(training: TrainingService, max_body: int, owner: Owner) -> APIRouter:
    routes = APIRouter()

    @routes.post("/api/v1/create_model")
    def create_model(body: CreateModelBody, who: str = Depends(owner)) -> dict[str, Any]:
        return training.create_model(who, body)

    @routes.post("/api/v1/get_info")
    def get_info(body: ModelIdBody, who: str = Depends(owner)) -> dict[str, Any]:
        return training.get_info(who, body.model_id)

    @routes.post("/api/v1/forward_backward", openapi_extra=FORWARD_BACKWARD_BODY)
    async def forward_backward(request: Request, who: str = Depends(owner)) -> dict[str, Any]:
        return await _forward_backward(training, max_body, request, who, False)

    @routes.post("/api/v1/forward", openapi_extra=FORWARD_BACKWARD_BODY)
    async def forward(request: Request, who: str = Depends(owner)) -> dict[str, Any]:
        return await _forward_backward(training, max_body, request, who, True)

    @routes.post("/api/v1/optim_step")
    def optim_step(body: OptimStepBody, who: str = Depends(owner)) -> dict[str, Any]:
        return training.optim_step(who, body)

    @routes.post("/api/v1/save_weights")
    def save_weights(body: SaveWeightsBody, who: str = Depends(owner)) -> dict[str, Any]:
        return training.save_weights(who, body)

    @routes.post("/api/v1/save_weights_for_sampler")
    def save_weights_for_sampler(body: SaveWeightsForSamplerBody, who: str = Depends(owner)) -> dict[str, Any]:
        return training.save_weights_for_sampler(who, body)

    @routes.post("/api/v1/save_weights_external")
    def save_weights_external(body: SaveWeightsExternalBody, who: str = Depends(owner)) -> dict[str, Any]:
        return training.save_weights_external(who, body)

    @routes.post("/api/v1/load_weights")
    def load_weights(body: LoadWeightsBody, who: str = Depends(owner)) -> dict[str, Any]:
        return training.load_weights(who, body)

    return routes
