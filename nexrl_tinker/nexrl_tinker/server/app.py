"""The FastAPI application: every route SDK 0.38 uses, thin over the services.

Handlers parse and authenticate, then call a service; errors become 4xx JSON bodies
with a ``detail`` message (never an empty body, never a 500 for bad input). Most
handlers are plain functions, which FastAPI runs on its thread pool, because they
touch SQL; ``retrieve_future`` is a coroutine so that a long-poll holds no thread.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
from fastapi import Depends, FastAPI, Header, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from nexrl_core.capabilities import NEXRL_CAPABILITIES_ROUTE, NexrlCapabilities
from nexrl_core.openapi import json_body
from nexrl_service.runtime import (
    ApiError,
    Authenticator,
    BadRequest,
    Forbidden,
    NotFound,
    Page,
    ServiceState,
    TooManyRequests,
    add_download_route,
    add_hub_routes,
)
from nexrl_tinker.server.codec import (
    FORWARD_BACKWARD_JSON,
    FwdBwdRequest,
    decode_forward_backward,
    decode_forward_backward_json,
    decompress_body,
    forward_backward_ids,
)
from nexrl_tinker.server.copies import CopyService
from nexrl_tinker.server.runs import RunService
from nexrl_tinker.server.sampling import SamplingService
from nexrl_tinker.server.schemas import (
    CopyWeightsBody,
    CreateModelBody,
    CreateSamplingSessionBody,
    CreateSessionBody,
    FinishSessionBody,
    HeartbeatBody,
    LoadWeightsBody,
    ModelIdBody,
    OptimStepBody,
    RetrieveFutureBody,
    SampleBody,
    SaveWeightsBody,
    SaveWeightsExternalBody,
    SaveWeightsForSamplerBody,
)
from nexrl_tinker.server.service import TELEMETRY_ANSWER, TELEMETRY_PATH
from nexrl_tinker.server.sessions import SessionService
from nexrl_tinker.server.training import TrainingService

__all__ = ["create_app"]

log = logging.getLogger("nexrl_tinker.server")

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


def _validation_message(exc: RequestValidationError) -> tuple[int, str]:
    errors = exc.errors()
    for error in errors:
        if error.get("type") == "json_invalid":
            return 400, f"malformed JSON body: {error.get('ctx', {}).get('error', error.get('msg'))}"
    parts = []
    for error in errors[:8]:
        location = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
        parts.append(f"{location or 'body'}: {error.get('msg')}")
    return 422, "invalid request body: " + "; ".join(parts)


def _route_message(request: Request, exc: StarletteHTTPException) -> str:
    """Starlette's bare "Not Found" / "Method Not Allowed" for a path no route serves, in words."""
    route = f"{request.method} {request.url.path}"
    if exc.status_code == 404 and exc.detail == "Not Found":
        return f"this service has no route {route}: NexRL's TinkerCloud serves the routes of tinker SDK 0.38 (see nexrl_tinker's README)"
    if exc.status_code == 405 and exc.detail == "Method Not Allowed":
        allowed = (exc.headers or {}).get("allow")
        return f"{route} is not served here" + (f"; this path answers {allowed}" if allowed else "")
    return str(exc.detail)


def _check_access_scope(access_scope: str) -> None:
    """``owned`` and ``accessible`` list the same here: one API key is one tenant, with no organization to share with."""
    if access_scope not in ("owned", "accessible"):
        raise BadRequest(f"access_scope must be 'owned' or 'accessible', got {access_scope!r}")


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


API_KEY_PREFIX = "tml-"
"""The SDK refuses to start without a ``tml-...`` key; without a configured key, the
server accepts exactly those (and the key names the tenant)."""


def create_app(state: ServiceState) -> FastAPI:
    app = FastAPI(title="NexRL TinkerCloud", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = state
    auth = Authenticator(
        state.settings.api_key,
        header="X-API-Key",
        required_prefix=API_KEY_PREFIX,
        missing_hint="the tinker SDK sends TINKER_API_KEY there",
    )
    sessions = SessionService(state)
    training = TrainingService(state)
    sampling = SamplingService(state, training.ops)
    runs = RunService(state)
    copies = CopyService(state)
    max_body = state.settings.max_body_bytes

    async def owner(x_api_key: str | None = Header(default=None, alias="X-API-Key")) -> str:
        # A coroutine: FastAPI would run a plain function on its thread pool (a hop per request).
        return auth.check(x_api_key)

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        # A reached limit (429) stays reached when the SDK retries at once: it should not.
        headers = {"x-should-retry": "false"} if isinstance(exc, TooManyRequests) else None
        return JSONResponse({"detail": exc.message}, status_code=exc.status_code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        status, message = _validation_message(exc)
        if status != 422:
            return JSONResponse({"detail": message}, status_code=status)
        # ``detail`` is the list of errors FastAPI's schema of a 422 promises; ``message`` says it in words.
        return JSONResponse({"detail": jsonable_encoder(exc.errors()), "message": message}, status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def _no_route(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"detail": _route_message(request, exc)}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal_error(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return JSONResponse({"detail": f"internal server error: {type(exc).__name__}: {exc}"}, status_code=500)

    # --- client bootstrap and health ------------------------------------------------------------

    @app.get("/api/v1/healthz")
    def healthz() -> dict[str, Any]:
        return {"status": "ok", "requests_in_flight": state.book.in_flight, "epoch": state.book.epoch}

    @app.post("/api/v1/client/config")
    def client_config(_owner: str = Depends(owner)) -> dict[str, Any]:
        return CLIENT_CONFIG

    @app.post("/api/v1/client/dynamic_config")
    def dynamic_config(_owner: str = Depends(owner)) -> dict[str, Any]:
        return DYNAMIC_CONFIG

    @app.post(TELEMETRY_PATH)
    async def telemetry(_owner: str = Depends(owner)) -> dict[str, Any]:
        return dict(TELEMETRY_ANSWER)

    @app.get("/api/v1/get_server_capabilities")
    def capabilities(_owner: str = Depends(owner)) -> dict[str, Any]:
        served = [(state.base, True), *((model, False) for model in state.sampling_models)]
        return {
            "supported_models": [
                {"model_name": model.name, "max_context_length": model.max_context_length, "trainable": trainable, "sampleable": True}
                for model, trainable in served
            ]
        }

    @app.get(NEXRL_CAPABILITIES_ROUTE)
    def nexrl_capabilities(_owner: str = Depends(owner)) -> dict[str, Any]:
        """Tells NexRL's own holder that every registered loss and all its options work
        here, and the precision this service trains in."""
        return NexrlCapabilities(
            dtype=state.settings.dtype, max_context_length=state.base.max_context_length, device=state.settings.device
        ).to_json()

    # --- sessions -------------------------------------------------------------------------------

    @app.post("/api/v1/create_session")
    def create_session(body: CreateSessionBody, who: str = Depends(owner)) -> dict[str, Any]:
        return sessions.create(who, body)

    @app.post("/api/v1/session_heartbeat")
    def session_heartbeat(body: HeartbeatBody, who: str = Depends(owner)) -> dict[str, Any]:
        return sessions.heartbeat(who, body.session_id)

    @app.post("/api/v1/sessions/{session_id}/finish")
    def finish_session(session_id: str, body: FinishSessionBody | None = None, who: str = Depends(owner)) -> dict[str, Any]:
        return sessions.finish(who, session_id, body)

    @app.get("/api/v1/sessions")
    def list_sessions(
        limit: int = 20, offset: int = 0, access_scope: str = "owned", who: str = Depends(owner)
    ) -> dict[str, Any]:
        _check_access_scope(access_scope)
        return sessions.list(who, Page.of(limit, offset))

    @app.post("/api/v1/sessions/search")
    def search_sessions(_owner: str = Depends(owner)) -> dict[str, Any]:
        raise BadRequest(
            "search_sessions is not served here: it searches an organization's sessions across hosted Tinker's "
            "projects; list this API key's sessions with list_sessions(limit, offset) and read each with get_session"
        )

    @app.get("/api/v1/sessions/{session_id}")
    def get_session(session_id: str, access_scope: str = "owned", who: str = Depends(owner)) -> dict[str, Any]:
        _check_access_scope(access_scope)
        return sessions.get(who, session_id)

    @app.put("/api/v1/sessions/{session_id}/project")
    def assign_session_project(session_id: str, body: dict[str, Any], who: str = Depends(owner)) -> dict[str, Any]:
        return sessions.assign_project(who, session_id, body.get("project_id"))

    @app.get("/api/v1/sessions/{session_id}/trace_export")
    def export_session_trace(session_id: str, who: str = Depends(owner)) -> dict[str, Any]:
        state.own_session(who, session_id)
        raise BadRequest(
            "export_session_trace is not served here: the Perfetto trace is built from hosted Tinker's request "
            "telemetry, which this service does not record; its own log (nexrl serve tinker) shows each request"
        )

    # --- an organization's reports (AdminClient), which hosted Tinker keeps and this service has not -----

    for path, refusal in HOSTED_REPORTS.items():
        app.add_api_route(path, _refuse(refusal), methods=["GET"], dependencies=[Depends(owner)])

    # --- training -------------------------------------------------------------------------------

    @app.post("/api/v1/create_model")
    def create_model(body: CreateModelBody, who: str = Depends(owner)) -> dict[str, Any]:
        return training.create_model(who, body)

    @app.post("/api/v1/get_info")
    def get_info(body: ModelIdBody, who: str = Depends(owner)) -> dict[str, Any]:
        return training.get_info(who, body.model_id)

    async def _forward_backward(request: Request, who: str, forward_only: bool) -> dict[str, Any]:
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

    @app.post(
        "/api/v1/forward_backward",
        openapi_extra=json_body(FORWARD_BACKWARD_JSON, required=("model_id",)),
        # or the same request in the SDK's binary encoding (application/octet-stream)
    )
    async def forward_backward(request: Request, who: str = Depends(owner)) -> dict[str, Any]:
        return await _forward_backward(request, who, False)

    @app.post(
        "/api/v1/forward",
        openapi_extra=json_body(FORWARD_BACKWARD_JSON, required=("model_id",)),
        # or the same request in the SDK's binary encoding (application/octet-stream)
    )
    async def forward(request: Request, who: str = Depends(owner)) -> dict[str, Any]:
        return await _forward_backward(request, who, True)

    @app.post("/api/v1/optim_step")
    def optim_step(body: OptimStepBody, who: str = Depends(owner)) -> dict[str, Any]:
        return training.optim_step(who, body)

    @app.post("/api/v1/save_weights")
    def save_weights(body: SaveWeightsBody, who: str = Depends(owner)) -> dict[str, Any]:
        return training.save_weights(who, body)

    @app.post("/api/v1/save_weights_for_sampler")
    def save_weights_for_sampler(body: SaveWeightsForSamplerBody, who: str = Depends(owner)) -> dict[str, Any]:
        return training.save_weights_for_sampler(who, body)

    @app.post("/api/v1/save_weights_external")
    def save_weights_external(body: SaveWeightsExternalBody, who: str = Depends(owner)) -> dict[str, Any]:
        return training.save_weights_external(who, body)

    @app.post("/api/v1/load_weights")
    def load_weights(body: LoadWeightsBody, who: str = Depends(owner)) -> dict[str, Any]:
        return training.load_weights(who, body)

    # --- sampling -------------------------------------------------------------------------------

    @app.post("/api/v1/create_sampling_session")
    def create_sampling_session(body: CreateSamplingSessionBody, who: str = Depends(owner)) -> dict[str, Any]:
        return sampling.create_session(who, body)

    @app.get("/api/v1/samplers/{sampler_id}")
    def get_sampler(sampler_id: str, who: str = Depends(owner)) -> dict[str, Any]:
        return sampling.get_sampler(who, sampler_id)

    @app.post("/api/v1/asample")
    def asample(body: SampleBody, who: str = Depends(owner)) -> dict[str, Any]:
        return sampling.asample(who, body)

    # --- futures --------------------------------------------------------------------------------

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(body: RetrieveFutureBody, who: str = Depends(owner)) -> Response:
        request_id = body.request_id
        submitter = state.book.owner_in_memory(request_id)
        if submitter is None:
            submitter = await run_in_threadpool(state.book.owner_of, request_id)
        if submitter is None:
            raise NotFound(f"unknown request_id {request_id!r} (never submitted, or its result expired)")
        if submitter != who:
            raise Forbidden(f"request {request_id!r} belongs to another session (a different API key)")
        outcome = await state.book.wait(request_id, state.settings.long_poll_s)
        if outcome is None:
            return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        state.book.note_fetched(request_id)
        if outcome.status == "failed":
            # The SDK raises this as tinker.RequestFailedError.
            return JSONResponse({"error": outcome.error, "category": outcome.category or "unknown"})
        return Response(outcome.payload, media_type=outcome.content_type)

    # --- training runs and checkpoints (RestClient) -----------------------------------------------

    @app.get("/api/v1/training_runs")
    def list_training_runs(
        limit: int = 20,
        offset: int = 0,
        access_scope: str = "owned",
        project_id: str | None = None,
        who: str = Depends(owner),
    ) -> dict[str, Any]:
        _check_access_scope(access_scope)
        return runs.list(who, Page.of(limit, offset), project_id)

    @app.get("/api/v1/training_runs/{training_run_id}")
    def get_training_run(training_run_id: str, access_scope: str = "owned", who: str = Depends(owner)) -> dict[str, Any]:
        _check_access_scope(access_scope)
        return runs.get(who, training_run_id)

    @app.get("/api/v1/training_runs/{training_run_id}/checkpoints")
    def list_checkpoints(training_run_id: str, who: str = Depends(owner)) -> dict[str, Any]:
        return runs.checkpoints(who, training_run_id)

    @app.get("/api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
    def external_weights_urls(
        training_run_id: str, checkpoint_id: str, request: Request, who: str = Depends(owner)
    ) -> dict[str, Any]:
        return runs.external_weights_urls(who, training_run_id, checkpoint_id, str(request.base_url))

    # Segment and name as two parameters: ``DELETE .../weights/publish`` deletes a checkpoint
    # named "publish", ``DELETE .../weights/x/publish`` unpublishes "x".
    @app.post("/api/v1/training_runs/{training_run_id}/checkpoints/{segment}/{name}/publish")
    def publish_checkpoint(training_run_id: str, segment: str, name: str, who: str = Depends(owner)) -> dict[str, Any]:
        return runs.publish(who, training_run_id, f"{segment}/{name}", True)

    @app.delete("/api/v1/training_runs/{training_run_id}/checkpoints/{segment}/{name}/publish")
    def unpublish_checkpoint(training_run_id: str, segment: str, name: str, who: str = Depends(owner)) -> dict[str, Any]:
        return runs.publish(who, training_run_id, f"{segment}/{name}", False)

    @app.put("/api/v1/training_runs/{training_run_id}/checkpoints/{segment}/{name}/ttl")
    def set_checkpoint_ttl(
        training_run_id: str, segment: str, name: str, body: dict[str, Any], who: str = Depends(owner)
    ) -> dict[str, Any]:
        return runs.set_ttl(who, training_run_id, f"{segment}/{name}", body)

    @app.delete("/api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id:path}")
    def delete_checkpoint(training_run_id: str, checkpoint_id: str, who: str = Depends(owner)) -> dict[str, Any]:
        return runs.delete_checkpoint(who, training_run_id, checkpoint_id)

    @app.get("/api/v1/checkpoints")
    def list_user_checkpoints(limit: int = 100, offset: int = 0, who: str = Depends(owner)) -> dict[str, Any]:
        return runs.user_checkpoints(who, Page.of(limit, offset))

    @app.post("/api/v1/copy_weights")
    def copy_weights(
        body: CopyWeightsBody,
        idempotency_key: str | None = Header(default=None, alias="X-Idempotency-Key"),
        access_token: str | None = Header(default=None, alias="X-Tinker-Weights-Access-Token"),
        who: str = Depends(owner),
    ) -> dict[str, Any]:
        return copies.copy(who, body, idempotency_key, access_token)

    @app.post("/api/v1/weights_info")
    def weights_info(body: dict[str, Any], who: str = Depends(owner)) -> dict[str, Any]:
        return runs.weights_info(who, body.get("tinker_path"))

    # Signed downloads of external weights: no API key, the URL's signature is the credential.
    add_download_route(app, state.downloads)
    # The tokenizer and config by the model's names, for HF_ENDPOINT=<this URL>/hf (bearer key).
    add_hub_routes(app, state.hub, state.settings.api_key)

    return app
