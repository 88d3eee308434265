"""Sampling: sampling sessions created and read, and samples asked for."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from nexrl_tinker.server.routes import Owner
from nexrl_tinker.server.sampling import SamplingService
from nexrl_tinker.server.schemas import CreateSamplingSessionBody, SampleBody

__all__ = ["router"]


def router(sampling: SamplingService, owner: Owner) -> APIRouter:
    routes = APIRouter()

    @routes.post("/api/v1/create_sampling_session")
    def create_sampling_session(body: CreateSamplingSessionBody, who: str = Depends(owner)) -> dict[str, Any]:
        return sampling.create_session(who, body)

    @routes.get("/api/v1/samplers/{sampler_id}")
    def get_sampler(sampler_id: str, who: str = Depends(owner)) -> dict[str, Any]:
        return sampling.get_sampler(who, sampler_id)

    @routes.post("/api/v1/asample")
    def asample(body: SampleBody, who: str = Depends(owner)) -> dict[str, Any]:
        return sampling.asample(who, body)

    return routes
