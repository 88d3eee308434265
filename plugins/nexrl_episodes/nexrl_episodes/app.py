"""The episode server's HTTP routes: claim / end over JSON, and an OpenAI endpoint per episode.

Bodies are parsed here, not by pydantic models, so a malformed body gets a 4xx whose
message names the field and what it should be (never a 500), in OpenAI's error shape
``{"error": {"message", "type", "code"}}`` that the ``openai`` client shows. The
episode's key travels as ``Authorization: Bearer <key>``, as the ``openai`` client
sends it; the book decides whether it still works.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from nexrl_core.http.openapi import OBJECT, json_body
from nexrl_episodes.book import EpisodeBook, EpisodeError
from nexrl_episodes.openai_api import OpenAIEndpoints

MAX_CLAIM_WAIT_S = 30.0
"""Longest a claim may wait for an episode (``wait_s``) before answering that none came."""

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error"}


def error_response(status: int, message: str) -> JSONResponse:
    kind = _ERROR_TYPES.get(status, "conflict_error" if status == 409 else "invalid_request_error" if status < 500 else "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


async def json_object(request: Request) -> dict[str, Any]:
    """The body as a JSON object, or a 400 saying what it was instead."""
    try:
        raw = await request.body()
    except ClientDisconnect:
        raise EpisodeError(400, "the client disconnected before sending its whole body") from None
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except ValueError as error:
        raise EpisodeError(400, f"the body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise EpisodeError(400, f"the body must be a JSON object, got {type(body).__name__}")
    return body


def bearer(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" else None


def optional_string(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise EpisodeError(400, f"{name} must be a string, got {type(value).__name__}")
    return value


def worker_key_check(api_key: str | None) -> Callable[[Request], None]:
    """What refuses a claim or a config read without the server's key (none set: all pass)."""
    expected = api_key.encode("utf-8") if api_key else None

    def check(request: Request) -> None:
        if expected is None:
            return
        key = bearer(request)
        if not key:
            raise EpisodeError(401, "this episode server needs its API key: send 'Authorization: Bearer <api_key>'")
        if not hmac.compare_digest(key.encode("utf-8"), expected):
            raise EpisodeError(401, "wrong API key for this episode server")

    return check


async def claim(book: EpisodeBook, waiting: _QueueSignal, request: Request, base_url: str) -> dict[str, Any]:
    """``/claim_episode``: the next queued episode for the body's ``client_id``, waiting up
    to ``wait_s`` for one; an episode claimed for a client that hung up meanwhile goes
    back to the queue."""
    body = await json_object(request)
    client_id = optional_string(body, "client_id")
    wait_s = body.get("wait_s", 0)
    if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not 0 <= wait_s <= MAX_CLAIM_WAIT_S:
        raise EpisodeError(400, f"wait_s must be a number of seconds between 0 and {MAX_CLAIM_WAIT_S:g}, got {wait_s!r}")
    claimed = book.claim(client_id)
    deadline = time.monotonic() + wait_s
    waited = False
    while claimed is None and book.engine_status != "offline" and time.monotonic() < deadline:
        await waiting.wait(deadline - time.monotonic())
        waited = True
        claimed = book.claim(client_id)
    if claimed is not None and waited and await request.is_disconnected():
        book.return_undelivered(claimed[0])
        raise EpisodeError(400, "the client hung up while waiting for an episode")
    if claimed is None:
        return {
            "episode_id": None,
            "engine_status": book.engine_status,
            "retry_after_s": 0.2 if book.engine_status == "rolling" else 1.0,
        }
    episode, key = claimed
    return {
        "episode_id": episode.episode_id,
        "task": episode.request.item,
        "task_id": episode.request.task_id,
        "is_val": episode.request.is_val,
        "base_url": f"{base_url}/episodes/{episode.episode_id}/v1",
        "api_key": key,
        "model": book.model,
        "claim_timeout_s": book.claim_timeout_s,
    }


def create_app(
    book: EpisodeBook,
    *,
    endpoints: OpenAIEndpoints | None,
    base_url: Callable[[], str],
    api_key: str | None,
    train_config: dict[str, Any],
) -> FastAPI:
    """Routes over ``book``; ``endpoints`` serves the model (None: claim/end only, e.g. a benchmark)."""
    app = FastAPI(title="NexRL episode server", docs_url=None, redoc_url=None, openapi_url=None)
    check_worker_key = worker_key_check(api_key)
    waiting = _QueueSignal()
    book.listeners.append(waiting.notify)

    @app.exception_handler(EpisodeError)
    async def _refused(_request: Request, error: EpisodeError) -> JSONResponse:
        return error_response(error.status, error.message)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/claim_episode", openapi_extra=json_body({"client_id": {"type": "string"}, "wait_s": {"type": "number"}}, optional=True))
    async def claim_episode(request: Request) -> dict[str, Any]:
        check_worker_key(request)
        return await claim(book, waiting, request, base_url())

    @app.post(
        "/end_episode",
        openapi_extra=json_body(
            {"episode_id": {"type": "string"}, "reward": {"type": "number"}, "metadata": OBJECT}, required=("episode_id", "reward")
        ),
    )
    async def end_episode(request: Request) -> dict[str, Any]:
        body = await json_object(request)
        episode_id = body.get("episode_id")
        if not isinstance(episode_id, str):
            raise EpisodeError(400, "episode_id (a string: the id a claim returned) is required")
        if "reward" not in body:
            raise EpisodeError(400, "reward (a finite number) is required")
        duplicate = book.end(bearer(request), episode_id, body["reward"], body.get("metadata"))
        return {"episode_id": episode_id, "ended": True, "duplicate": duplicate}

    @app.post("/abort_episode", openapi_extra=json_body({"reason": {"type": "string"}}, optional=True))
    async def abort_episode(request: Request) -> dict[str, Any]:
        body = await json_object(request)
        book.abort(bearer(request), optional_string(body, "reason") or "")
        return {"aborted": True}

    @app.post("/can_continue_episode")
    async def can_continue_episode(request: Request) -> dict[str, Any]:
        can, reason = book.can_continue(bearer(request))
        return {"can_continue": can, "reason": reason}

    @app.get("/get_engine_status")
    async def get_engine_status() -> dict[str, Any]:
        return {
            "status": book.engine_status,
            "policy_version": book.policy_version,
            "queued": book.queued(),
            "running": book.running(),
        }

    @app.post("/sync_train_config", openapi_extra=json_body(optional=True))
    async def sync_train_config(request: Request) -> dict[str, Any]:
        """The run's settings a client should follow; the training run owns them, so a
        client cannot overwrite them (a body is refused rather than ignored)."""
        check_worker_key(request)
        if await json_object(request):
            raise EpisodeError(400, "the training run owns its config: send an empty body to read it")
        return train_config

    if endpoints is not None:
        endpoints.add_routes(app)
    return app


class _QueueSignal:
    """Wakes claims that wait for work (``wait_s``) when episodes join the queue, from any thread."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    def notify(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None

    async def wait(self, timeout: float) -> None:
        self._loop = asyncio.get_running_loop()
        if self._event is None:
            self._event = asyncio.Event()
        event = self._event
        try:
            await asyncio.wait_for(event.wait(), max(timeout, 0.0))
        except asyncio.TimeoutError:
            pass
