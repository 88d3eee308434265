"""Sampling sessions: created, read and deleted; samples and prompt log-probs asked for."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool

from nexrl_weaver.server.routes import Bodies, Owner
from nexrl_weaver.server.routes.schemas import INTEGERS, SAMPLE_BODY, SAMPLER_BODY, described_body, model_input
from nexrl_weaver.server.sampling import WeaverSampling

__all__ = ["router"]


def router(sampling: WeaverSampling, bodies: Bodies, owner: Owner) -> APIRouter:
    routes = APIRouter()

    @routes.post("/api/v1/sessions/{session_id}/sampling-sessions", openapi_extra=described_body(SAMPLER_BODY))
    async def create_sampling_session(session_id: str, request: Request, who: str = Depends(owner)) -> dict[str, Any]:
        return await run_in_threadpool(sampling.create_session, who, session_id, await bodies.json(request))

    @routes.get("/api/v1/sampling-sessions/{sampler_id}")
    def get_sampling_session(sampler_id: str, who: str = Depends(owner)) -> dict[str, Any]:
        return sampling.get_session(who, sampler_id)

    @routes.delete("/api/v1/sampling-sessions/{sampler_id}")
    def delete_sampling_session(sampler_id: str, who: str = Depends(owner)) -> dict[str, Any]:
        return sampling.delete_session(who, sampler_id)

    @routes.post("/api/v1/sampling-sessions/{sampler_id}/samples", openapi_extra=described_body(SAMPLE_BODY, required=("prompt",)))
    async def sample(sampler_id: str, request: Request, who: str = Depends(owner)) -> dict[str, Any]:
        return await bodies.submitted(sampling.sample, who, sampler_id, await bodies.json(request))

    @routes.post(
        "/api/v1/sampling-sessions/{sampler_id}/logprobs",
        openapi_extra=described_body({"prompt": model_input(INTEGERS)}, required=("prompt",)),
    )
    async def logprobs(sampler_id: str, request: Request, who: str = Depends(owner)) -> dict[str, Any]:
        return await bodies.submitted(sampling.logprobs, who, sampler_id, await bodies.json(request))

    return routes
