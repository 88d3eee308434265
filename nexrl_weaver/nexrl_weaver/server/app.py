"""The FastAPI application: the nex-weaver 1.19 routes, thin over the Weaver modules.

Handlers authenticate (``X-WEAVER-API-KEY``; without a configured key the SDK may
send none), read the body, and call `WeaverSessions`, `WeaverTraining` or
`WeaverSampling`. Operations answer as envelopes (`operations.envelope`): a
submission waits up to ``submit_wait_s`` for its result, so a quick operation needs
no poll, and otherwise answers ``pending`` long before the SDK's 60 s read timeout
(a timed-out POST is re-sent); ``GET /operations/{id}`` holds up to ``long_poll_s``.
Errors are Weaver's JSON body ``{"error", "message", "retryable"}`` with a 4xx for
bad input, never an empty body.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

import attrs
from fastapi import Depends, FastAPI, Header, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from nexrl_core.capabilities import NEXRL_CAPABILITIES_ROUTE, NexrlCapabilities
from nexrl_core.config.adamw import AdamWSettings
from nexrl_core.openapi import OBJECT
from nexrl_core.openapi import json_body as described_body
from nexrl_service.runtime import SQL_INT_MAX, ApiError, Authenticator, BadRequest, Forbidden, NotFound, ServiceState, add_download_route
from nexrl_weaver.server import operations
from nexrl_weaver.server.artifacts import CHECKPOINT_EXPORT_REFUSAL, WeaverArtifacts
from nexrl_weaver.server.sampling import WeaverSampling
from nexrl_weaver.server.sessions import WeaverSessions
from nexrl_weaver.server.tensors import DTYPES, TensorPack, parse_multipart
from nexrl_weaver.server.training import WeaverTraining

__all__ = ["create_app"]

log = logging.getLogger("nexrl_weaver.server")

ERROR_CODES = {
    400: "invalid_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 410: "gone", 422: "invalid_request",
    429: "limit_reached",
    501: "not_supported",
}


def _error(status: int, message: str, headers: Mapping[str, str] | None = None, **extra: Any) -> JSONResponse:
    return JSONResponse(
        {"error": ERROR_CODES.get(status, "error" if status < 500 else "internal_error"), "message": message, "retryable": False, **extra},
        status_code=status,
        headers=headers,
    )


# What the routes that read their bodies by hand (`nexrl_weaver.server.bodies`) take, for
# the app's OpenAPI schema, down to every number a client sends, so a fuzzer built on the
# schema reaches each one's check; the handlers check every field and name what is wrong.
STRING, INTEGER, NUMBER, BOOLEAN = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
INTEGERS = {"type": "array", "items": INTEGER}
SEQ_ID = {"type": "integer", "minimum": 0, "maximum": SQL_INT_MAX}
TENSOR = {
    "anyOf": [
        {"type": "array", "items": NUMBER},
        {
            "type": "object",
            "properties": {"data": {"type": "array", "items": NUMBER}, "dtype": {"type": "string", "enum": sorted(DTYPES)}, "shape": INTEGERS},
            "required": ["data"],
        },
    ]
}
"""A tensor as JSON (`nexrl_weaver.server.tensors.to_array`); ``$tensor`` slices come only in a multipart body."""


def model_input(tokens: Mapping[str, Any]) -> dict[str, Any]:
    """``{"chunks": [{"type": "encoded_text", "tokens": ...}]}`` with ``tokens`` as given."""
    chunk = {"type": "object", "properties": {"type": {"type": "string", "enum": ["encoded_text"]}, "tokens": tokens}, "required": ["tokens"]}
    return {"type": "object", "properties": {"chunks": {"type": "array", "items": chunk}}, "required": ["chunks"]}


def payload_body(properties: Mapping[str, Any]) -> dict[str, Any]:
    """``{"payload": {...}}``, the body of a training operation, with the payload's fields."""
    payload = {"type": "object", "properties": {"model_id": STRING, "seq_id": SEQ_ID, **properties}}
    return described_body({"payload": payload}, required=("payload",))


FORWARD_INPUT = {
    "type": "object",
    "properties": {
        "loss_fn": STRING,
        "loss_fn_config": {"type": "object", "additionalProperties": {"type": ["number", "string"]}},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"model_input": model_input(TENSOR), "loss_fn_inputs": {"type": "object", "additionalProperties": TENSOR}},
                "required": ["model_input", "loss_fn_inputs"],
            },
        },
    },
    "required": ["loss_fn", "data"],
}
ADAM_PARAMS = {"type": "object", "properties": {field.name: NUMBER for field in attrs.fields(AdamWSettings)}}
LORA_CONFIG = {
    "type": "object",
    "properties": {"rank": INTEGER, "seed": INTEGER, "train_mlp": BOOLEAN, "train_attn": BOOLEAN, "train_unembed": BOOLEAN},
}
SAMPLING_PARAMS = {
    "type": "object",
    "properties": {
        "max_tokens": INTEGER, "temperature": NUMBER, "top_p": NUMBER, "top_k": INTEGER, "seed": INTEGER, "sampling_seed": INTEGER,
        "stop": {"type": "array", "items": STRING}, "stop_token_ids": INTEGERS,
    },
}  # fmt: skip
SESSION_BODY = {"user_metadata": OBJECT, "tags": {"type": "array", "items": STRING}}
MODEL_BODY = {"base_model": STRING, "model_seq_id": SEQ_ID, "training_mode": STRING, "lora_config": LORA_CONFIG, "user_metadata": OBJECT}
SAMPLER_BODY = {"base_model": STRING, "model_id": STRING, "checkpoint_id": STRING, "sampling_session_seq_id": SEQ_ID}
SAMPLE_BODY = {
    "prompt": model_input(INTEGERS), "num_samples": {"type": "integer", "minimum": 1}, "sampling_params": SAMPLING_PARAMS,
    "prompt_logprobs": BOOLEAN, "topk_prompt_logprobs": INTEGER,
}  # fmt: skip


def create_app(state: ServiceState) -> FastAPI:
    app = FastAPI(title="NexRL local Weaver service", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = state
    auth = Authenticator(
        state.settings.api_key,
        header="X-WEAVER-API-KEY",
        missing_hint="the nex-weaver SDK sends WEAVER_API_KEY there",
        allow_anonymous=True,
    )
    sessions = WeaverSessions(state)
    training = WeaverTraining(state)
    sampling = WeaverSampling(state, training.ops)
    artifacts = WeaverArtifacts(state, training)
    settings = state.settings
    book = state.book

    async def owner(key: str | None = Header(default=None, alias="X-WEAVER-API-KEY")) -> str:
        return auth.check(key)

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status_code, exc.message)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        # ``detail`` is the list FastAPI's schema of a 422 promises; ``message`` Weaver's text.
        return _error(422, f"invalid request: {exc.errors()[:4]}", detail=jsonable_encoder(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), exc.headers)  # a 405 keeps its Allow header

    @app.exception_handler(Exception)
    async def _internal_error(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return _error(500, f"internal server error: {type(exc).__name__}: {exc}")

    async def json_body(request: Request, *, optional: bool = False) -> dict[str, Any]:
        raw = await request.body()
        if len(raw) > settings.max_body_bytes:
            raise BadRequest(f"request body is larger than {settings.max_body_bytes} bytes")
        if not raw.strip():
            if optional:
                return {}
            raise BadRequest("the request needs a JSON object body")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequest(f"malformed JSON body: {exc}") from None
        if not isinstance(body, dict):
            kind = "null" if body is None else type(body).__name__
            raise BadRequest(f"the body must be a JSON object, got {kind}")
        return body

    async def submitted(submit: Callable[..., str], *args: Any) -> dict[str, Any]:
        """Run a submission, then wait briefly for its result (see the module docstring)."""
        operation_id = await run_in_threadpool(submit, *args)
        outcome = await book.wait(operation_id, settings.submit_wait_s)
        if outcome is not None:
            book.note_fetched(operation_id)
        return operations.envelope(operation_id, outcome)

    # --- health and catalogue ------------------------------------------------------------------

    @app.get("/api/v1/healthz")
    def healthz() -> dict[str, Any]:
        return {"status": "ok", "operations_in_flight": book.in_flight, "epoch": book.epoch}

    @app.get(NEXRL_CAPABILITIES_ROUTE)
    async def nexrl_capabilities(_owner: str = Depends(owner)) -> dict[str, Any]:
        """Tells NexRL's own holder that every registered loss and all its options work
        here, and the precision this service trains in."""
        return NexrlCapabilities(
            dtype=state.settings.dtype, max_context_length=state.base.max_context_length, device=state.settings.device
        ).to_json()

    @app.get("/api/v1/supported-models")
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

    # --- sessions -------------------------------------------------------------------------------

    @app.post("/api/v1/sessions", openapi_extra=described_body(SESSION_BODY, optional=True))
    async def create_session(request: Request, who: str = Depends(owner)) -> dict[str, Any]:
        return await run_in_threadpool(sessions.create, who, await json_body(request, optional=True))

    @app.get("/api/v1/sessions/{session_id}")
    def get_session(session_id: str, who: str = Depends(owner)) -> dict[str, Any]:
        return sessions.get(who, session_id)

    @app.post("/api/v1/sessions/{session_id}/heartbeat", status_code=204)
    def heartbeat(session_id: str, who: str = Depends(owner)) -> Response:
        sessions.heartbeat(who, session_id)
        return Response(status_code=204)

    @app.post("/api/v1/sessions/{session_id}/metrics", responses={501: {"description": "not supported here: the run's files hold its metrics"}})
    async def log_metrics(session_id: str, who: str = Depends(owner)) -> JSONResponse:
        """Not kept here (NexRL writes its metrics to the run directory): refused, not dropped."""
        await run_in_threadpool(state.own_session, who, session_id)
        return _error(501, "log_metrics is not supported by NexRL's local Weaver service; the run's metrics.jsonl and TensorBoard files hold them")

    # --- models ---------------------------------------------------------------------------------

    @app.post("/api/v1/sessions/{session_id}/models", openapi_extra=described_body(MODEL_BODY, required=("base_model",)))
    async def create_model(session_id: str, request: Request, who: str = Depends(owner)) -> dict[str, Any]:
        body = await json_body(request)
        answer, request_id = await run_in_threadpool(training.create_model, who, session_id, body)
        if request_id is not None:
            outcome = await book.wait(request_id, settings.submit_wait_s)
            if outcome is not None and outcome.status == "failed":
                raise BadRequest(f"could not create the model: {outcome.error}")
            if outcome is not None:
                answer["status"] = "ready"
        return answer

    @app.get("/api/v1/models/{model_id}")
    def get_model(model_id: str, who: str = Depends(owner)) -> dict[str, Any]:
        return training.get_model(who, model_id)

    @app.post("/api/v1/models/{model_id}/terminate")
    def terminate(model_id: str, who: str = Depends(owner)) -> dict[str, Any]:
        return training.terminate(who, model_id)

    async def _forward(model_id: str, request: Request, who: str, backward: bool) -> dict[str, Any]:
        content_type = request.headers.get("content-type", "")
        pack: TensorPack | None = None
        if content_type.startswith("multipart/"):
            raw = await request.body()
            if len(raw) > settings.max_body_bytes:
                raise BadRequest(f"request body is larger than {settings.max_body_bytes} bytes")
            body, pack = await run_in_threadpool(parse_multipart, raw, content_type, settings.max_body_bytes)
        else:
            body = await json_body(request)
        return await submitted(training.forward, who, model_id, body, pack, backward)

    @app.post("/api/v1/models/{model_id}/forward-passes", openapi_extra=payload_body({"forward_input": FORWARD_INPUT}))
    async def forward(model_id: str, request: Request, who: str = Depends(owner)) -> dict[str, Any]:
        return await _forward(model_id, request, who, False)

    @app.post(
        "/api/v1/models/{model_id}/forward-backward-passes", openapi_extra=payload_body({"forward_backward_input": FORWARD_INPUT})
    )
    async def forward_backward(model_id: str, request: Request, who: str = Depends(owner)) -> dict[str, Any]:
        return await _forward(model_id, request, who, True)

    @app.post("/api/v1/models/{model_id}/optimizer-steps", openapi_extra=payload_body({"adam_params": ADAM_PARAMS}))
    async def optimizer_step(model_id: str, request: Request, who: str = Depends(owner)) -> dict[str, Any]:
        return await submitted(training.optim_step, who, model_id, await json_body(request))

    @app.post("/api/v1/models/{model_id}/export-sampler", openapi_extra=described_body({"name": STRING, "seq_id": SEQ_ID}))
    async def export_sampler(model_id: str, request: Request, who: str = Depends(owner)) -> dict[str, Any]:
        return await submitted(training.export_sampler, who, model_id, await json_body(request))

    @app.post("/api/v1/models/{model_id}/checkpoints", openapi_extra=described_body({"name": STRING, "seq_id": SEQ_ID}, optional=True))
    async def save_checkpoint(model_id: str, request: Request, who: str = Depends(owner)) -> dict[str, Any]:
        return await submitted(training.save_checkpoint, who, model_id, await json_body(request, optional=True))

    @app.get("/api/v1/models/{model_id}/checkpoints")
    def list_checkpoints(model_id: str, who: str = Depends(owner)) -> dict[str, Any]:
        return training.list_checkpoints(who, model_id)

    @app.post("/api/v1/models/{model_id}/load", openapi_extra=described_body({"checkpoint_id": STRING, "seq_id": SEQ_ID}))
    async def load(model_id: str, request: Request, who: str = Depends(owner)) -> dict[str, Any]:
        return await submitted(training.load, who, model_id, await json_body(request))

    # --- HF weights export and download (see `nexrl_weaver.server.artifacts`) -------------------

    @app.post("/api/v1/models/{model_id}/export-hf", openapi_extra=described_body({"seq_id": SEQ_ID}, optional=True))
    async def export_hf(model_id: str, request: Request, who: str = Depends(owner)) -> dict[str, Any]:
        return await submitted(artifacts.export_current, who, model_id, await json_body(request, optional=True))

    @app.post("/api/v1/checkpoints/{checkpoint_id}/export")
    def export_checkpoint(checkpoint_id: str, _who: str = Depends(owner)) -> dict[str, Any]:
        raise BadRequest(CHECKPOINT_EXPORT_REFUSAL)

    @app.get("/api/v1/checkpoints/{checkpoint_id}/artifacts")
    def checkpoint_artifacts(checkpoint_id: str, _who: str = Depends(owner)) -> dict[str, Any]:
        raise BadRequest(f"artifacts are not listed by checkpoint here: {CHECKPOINT_EXPORT_REFUSAL} by its id")

    @app.get("/api/v1/artifacts/{artifact_id}")
    def get_artifact(artifact_id: str, who: str = Depends(owner)) -> dict[str, Any]:
        return artifacts.get(who, artifact_id)

    @app.get("/api/v1/artifacts/{artifact_id}/download")
    def artifact_download(artifact_id: str, request: Request, who: str = Depends(owner)) -> dict[str, Any]:
        return artifacts.descriptor(who, artifact_id, str(request.base_url))

    # Signed downloads of artifact files: no API key, the URL's signature is the credential.
    add_download_route(app, state.downloads)

    # --- sampling -------------------------------------------------------------------------------

    @app.post("/api/v1/sessions/{session_id}/sampling-sessions", openapi_extra=described_body(SAMPLER_BODY))
    async def create_sampling_session(session_id: str, request: Request, who: str = Depends(owner)) -> dict[str, Any]:
        return await run_in_threadpool(sampling.create_session, who, session_id, await json_body(request))

    @app.get("/api/v1/sampling-sessions/{sampler_id}")
    def get_sampling_session(sampler_id: str, who: str = Depends(owner)) -> dict[str, Any]:
        return sampling.get_session(who, sampler_id)

    @app.delete("/api/v1/sampling-sessions/{sampler_id}")
    def delete_sampling_session(sampler_id: str, who: str = Depends(owner)) -> dict[str, Any]:
        return sampling.delete_session(who, sampler_id)

    @app.post("/api/v1/sampling-sessions/{sampler_id}/samples", openapi_extra=described_body(SAMPLE_BODY, required=("prompt",)))
    async def sample(sampler_id: str, request: Request, who: str = Depends(owner)) -> dict[str, Any]:
        return await submitted(sampling.sample, who, sampler_id, await json_body(request))

    @app.post("/api/v1/sampling-sessions/{sampler_id}/logprobs", openapi_extra=described_body({"prompt": model_input(INTEGERS)}, required=("prompt",)))
    async def logprobs(sampler_id: str, request: Request, who: str = Depends(owner)) -> dict[str, Any]:
        return await submitted(sampling.logprobs, who, sampler_id, await json_body(request))

    # --- operations -----------------------------------------------------------------------------

    async def _own_operation(operation_id: str, who: str) -> None:
        submitter = book.owner_in_memory(operation_id)
        if submitter is None:
            submitter = await run_in_threadpool(book.owner_of, operation_id)
        if submitter is None:
            raise NotFound(f"unknown operation {operation_id!r} (never submitted, or its result expired)")
        if submitter != who:
            raise Forbidden(f"operation {operation_id!r} belongs to another API key")

    @app.get("/api/v1/operations/{operation_id}")
    async def get_operation(operation_id: str, who: str = Depends(owner)) -> dict[str, Any]:
        await _own_operation(operation_id, who)
        outcome = await book.wait(operation_id, settings.long_poll_s)
        if outcome is not None:
            book.note_fetched(operation_id)
        return operations.envelope(operation_id, outcome)

    @app.get("/api/v1/operations/{operation_id}/tensor-pack")
    async def get_tensor_pack(operation_id: str, who: str = Depends(owner)) -> Response:
        await _own_operation(operation_id, who)
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

    return app
