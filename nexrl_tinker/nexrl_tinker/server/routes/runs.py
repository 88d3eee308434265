"""RestClient's routes: training runs and their checkpoints (listed, published, given a
time to live, deleted, downloaded), and weights copied between runs."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Header, Request

from nexrl_service.runtime import Page
from nexrl_tinker.server.copies import CopyService
from nexrl_tinker.server.routes import Owner
from nexrl_tinker.server.routes.sessions import check_access_scope
from nexrl_tinker.server.runs import RunService
from nexrl_tinker.server.schemas import CopyWeightsBody

__all__ = ["router"]


def router(runs: RunService, copies: CopyService, owner: Owner) -> APIRouter:
    routes = APIRouter()

    @routes.get("/api/v1/training_runs")
    def list_training_runs(
        limit: int = 20,
        offset: int = 0,
        access_scope: str = "owned",
        project_id: str | None = None,
        who: str = Depends(owner),
    ) -> dict[str, Any]:
        check_access_scope(access_scope)
        return runs.list(who, Page.of(limit, offset), project_id)

    @routes.get("/api/v1/training_runs/{training_run_id}")
    def get_training_run(training_run_id: str, access_scope: str = "owned", who: str = Depends(owner)) -> dict[str, Any]:
        check_access_scope(access_scope)
        return runs.get(who, training_run_id)

    @routes.get("/api/v1/training_runs/{training_run_id}/checkpoints")
    def list_checkpoints(training_run_id: str, who: str = Depends(owner)) -> dict[str, Any]:
        return runs.checkpoints(who, training_run_id)

    @routes.get("/api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
    def external_weights_urls(training_run_id: str, checkpoint_id: str, request: Request, who: str = Depends(owner)) -> dict[str, Any]:
        return runs.external_weights_urls(who, training_run_id, checkpoint_id, str(request.base_url))

    # Segment and name as two parameters: ``DELETE .../weights/publish`` deletes a checkpoint
    # named "publish", ``DELETE .../weights/x/publish`` unpublishes "x".
    @routes.post("/api/v1/training_runs/{training_run_id}/checkpoints/{segment}/{name}/publish")
    def publish_checkpoint(training_run_id: str, segment: str, name: str, who: str = Depends(owner)) -> dict[str, Any]:
        return runs.publish(who, training_run_id, f"{segment}/{name}", True)

    @routes.delete("/api/v1/training_runs/{training_run_id}/checkpoints/{segment}/{name}/publish")
    def unpublish_checkpoint(training_run_id: str, segment: str, name: str, who: str = Depends(owner)) -> dict[str, Any]:
        return runs.publish(who, training_run_id, f"{segment}/{name}", False)

    @routes.put("/api/v1/training_runs/{training_run_id}/checkpoints/{segment}/{name}/ttl")
    def set_checkpoint_ttl(
        training_run_id: str, segment: str, name: str, body: dict[str, Any], who: str = Depends(owner)
    ) -> dict[str, Any]:
        return runs.set_ttl(who, training_run_id, f"{segment}/{name}", body)

    @routes.delete("/api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id:path}")
    def delete_checkpoint(training_run_id: str, checkpoint_id: str, who: str = Depends(owner)) -> dict[str, Any]:
        return runs.delete_checkpoint(who, training_run_id, checkpoint_id)

    @routes.get("/api/v1/checkpoints")
    def list_user_checkpoints(limit: int = 100, offset: int = 0, who: str = Depends(owner)) -> dict[str, Any]:
        return runs.user_checkpoints(who, Page.of(limit, offset))

    @routes.post("/api/v1/copy_weights")
    def copy_weights(
        body: CopyWeightsBody,
        idempotency_key: str | None = Header(default=None, alias="X-Idempotency-Key"),
        access_token: str | None = Header(default=None, alias="X-Tinker-Weights-Access-Token"),
        who: str = Depends(owner),
    ) -> dict[str, Any]:
        return copies.copy(who, body, idempotency_key, access_token)

    @routes.post("/api/v1/weights_info")
    def weights_info(body: dict[str, Any], who: str = Depends(owner)) -> dict[str, Any]:
        return runs.weights_info(who, body.get("tinker_path"))

    return routes
