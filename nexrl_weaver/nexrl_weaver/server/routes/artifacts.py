"""HF weight exports and their artifacts (see `nexrl_weaver.server.artifacts`); the files
themselves are signed downloads, which `nexrl_weaver.server.app` serves without a key."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from nexrl_service.runtime import BadRequest
from nexrl_weaver.server.artifacts import CHECKPOINT_EXPORT_REFUSAL, WeaverArtifacts
from nexrl_weaver.server.routes import Bodies, Owner
from nexrl_weaver.server.routes.schemas import SEQ_ID, described_body

__all__ = ["router"]


def router(artifacts: WeaverArtifacts, bodies: Bodies, owner: Owner) -> APIRouter:
    routes = APIRouter()

    @routes.post("/api/v1/models/{model_id}/export-hf", openapi_extra=described_body({"seq_id": SEQ_ID}, optional=True))
    async def export_hf(model_id: str, request: Request, who: str = Depends(owner)) -> dict[str, Any]:
        return await bodies.submitted(artifacts.export_current, who, model_id, await bodies.json(request, optional=True))

    @routes.post("/api/v1/checkpoints/{checkpoint_id}/export")
    def export_checkpoint(checkpoint_id: str, _who: str = Depends(owner)) -> dict[str, Any]:
        raise BadRequest(CHECKPOINT_EXPORT_REFUSAL)

    @routes.get("/api/v1/checkpoints/{checkpoint_id}/artifacts")
    def checkpoint_artifacts(checkpoint_id: str, _who: str = Depends(owner)) -> dict[str, Any]:
        raise BadRequest(f"artifacts are not listed by checkpoint here: {CHECKPOINT_EXPORT_REFUSAL} by its id")

    @routes.get("/api/v1/artifacts/{artifact_id}")
    def get_artifact(artifact_id: str, who: str = Depends(owner)) -> dict[str, Any]:
        return artifacts.get(who, artifact_id)

    @routes.get("/api/v1/artifacts/{artifact_id}/download")
    def artifact_download(artifact_id: str, request: Request, who: str = Depends(owner)) -> dict[str, Any]:
        return artifacts.descriptor(who, artifact_id, str(request.base_url))

    return routes
