"""What the SDK asks before any work: its configuration flags, health, the models this
service serves, and the hosted organization's reports, which are refused in words."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Depends

from nexrl_core.http.capabilities import NEXRL_CAPABILITIES_ROUTE, NexrlCapabilities
from nexrl_service.runtime import BadRequest, ServiceState
from nexrl_tinker.server.routes import Owner

__all__ = ["TELEMETRY_ANSWER", "TELEMETRY_PATH", "router"]

CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "credential_default_source": "api_key",
    "parallel_fwdbwd_chunks": True,
    "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": False,
    "sample_join_sampling_session": False,
    "custom_loss_server_side": False,
    "sample_enable_stuck_detection": True,
}
"""Flags for ``/client/config`` (tinker-protocol.md §7): no JWT exchange, no batch
futures endpoint, no server-side custom losses."""

DYNAMIC_CONFIG = {"refresh_interval_sec": 300, "sample_cancel_enabled": False, "sample_cancel_max_batch_size": 64}
"""``sample_cancel_enabled`` false: the SDK never sends ``cancel_future`` (this service has
no such route; a queued operation runs to completion)."""

TELEMETRY_PATH = "/api/v1/telemetry"
"""Where the tinker SDK posts its telemetry in the background."""
TELEMETRY_ANSWER = {"status": "accepted"}

HOSTED_REPORTS = {
    "/api/v1/audit": (
        "get_audit_log is not served here: it reads the audit log of a hosted Tinker organization, and this "
        "service has no organizations (one API key is one tenant); its own log (nexrl serve tinker) shows each request"
    ),
    "/api/v1/billing/usage/events": (
        "get_billing_usage is not served here: it reads hosted Tinker's billing, and this service bills nothing"
    ),
    "/api/v1/billing/usage/checkpoints/current": (
        "get_current_checkpoint_storage_usage is not served here: it prices hosted Tinker's checkpoint storage, "
        "and this service bills nothing; list_user_checkpoints gives each checkpoint's size_bytes"
    ),
}
"""AdminClient's routes (SDK 0.38 sends them; hosted Tinker gates them on an admin role):
a 400 that says why, rather than the 404 of a path no SDK uses."""


def _refuse(message: str) -> Callable[[], Awaitable[None]]:
    """A route handler that answers every request with a 400 saying ``message``."""

    async def refused() -> None:
        raise BadRequest(message)

    return refused


def router(state: ServiceState, owner: Owner) -> APIRouter:
    routes = APIRouter()

    @routes.get("/api/v1/healthz")
    def healthz() -> dict[str, Any]:
        return {"status": "ok", "requests_in_flight": state.book.in_flight, "epoch": state.book.epoch}

    @routes.post("/api/v1/client/config")
    def client_config(_owner: str = Depends(owner)) -> dict[str, Any]:
        return CLIENT_CONFIG

    @routes.post("/api/v1/client/dynamic_config")
    def dynamic_config(_owner: str = Depends(owner)) -> dict[str, Any]:
        return DYNAMIC_CONFIG

    @routes.post(TELEMETRY_PATH)
    async def telemetry(_owner: str = Depends(owner)) -> dict[str, Any]:
        return dict(TELEMETRY_ANSWER)

    @routes.get("/api/v1/get_server_capabilities")
    def capabilities(_owner: str = Depends(owner)) -> dict[str, Any]:
        served = [(state.base, True), *((model, False) for model in state.sampling_models)]
        return {
            "supported_models": [
                {"model_name": model.name, "max_context_length": model.max_context_length, "trainable": trainable, "sampleable": True}
                for model, trainable in served
            ]
        }

    @routes.get(NEXRL_CAPABILITIES_ROUTE)
    def nexrl_capabilities(_owner: str = Depends(owner)) -> dict[str, Any]:
        """Tells NexRL's own holder that every registered loss and all its options work
        here, and the precision this service trains in."""
        return NexrlCapabilities(
            dtype=state.settings.dtype, max_context_length=state.base.max_context_length, device=state.settings.device
        ).to_json()

    for path, refusal in HOSTED_REPORTS.items():
        routes.add_api_route(path, _refuse(refusal), methods=["GET"], dependencies=[Depends(owner)])
    return routes
