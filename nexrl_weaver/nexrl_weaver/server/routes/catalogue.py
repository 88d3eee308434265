"""Health, and what this service serves: its model and NexRL's capabilities."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from nexrl_core.http.capabilities import NEXRL_CAPABILITIES_ROUTE, NexrlCapabilities
from nexrl_service.runtime import ServiceState
from nexrl_weaver.server.routes import Owner

__all__ = ["router"]


def router(state: ServiceState, owner: Owner) -> APIRouter:
    routes = APIRouter()

    @routes.get("/api/v1/healthz")
    def healthz() -> dict[str, Any]:
        return {"status": "ok", "operations_in_flight": state.book.in_flight, "epoch": state.book.epoch}

    @routes.get(NEXRL_CAPABILITIES_ROUTE)
    async def nexrl_capabilities(_owner: str = Depends(owner)) -> dict[str, Any]:
        """Tells NexRL's own holder that every registered loss and all its options work
        here, and the precision this service trains in."""
        return NexrlCapabilities(
            dtype=state.settings.dtype, max_context_length=state.base.max_context_length, device=state.settings.device
        ).to_json()

    @routes.get("/api/v1/supported-models")
    async def supported_models(_owner: str = Depends(owner)) -> dict[str, Any]:
        base = state.base
        item = {
            "name": base.name,
            "status": "available",
            "training_modes": ["lora", "full_ft"],
            "max_context_length": base.max_context_length,
            "config": {"resource": {"tokenizer": {"path": str(base.directory)}}},
        }
        return {"items": [item], "pagination": {"total_count": 1, "limit": 100, "offset": 0}}

    return routes
