"""Every failure as the JSON body the tinker SDK reads: ``{"detail": message}``, a 4xx
for bad input, never an empty body (the SDK retries what looks like a proxy's
rejection) and never a 500 for something the client can fix."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from nexrl_service.runtime import ApiError, TooManyRequests

__all__ = ["install_error_handlers"]

log = logging.getLogger("nexrl_tinker.server")


def validation_message(exc: RequestValidationError) -> tuple[int, str]:
    """The status and words for a body FastAPI could not read: 400 for malformed JSON,
    422 naming up to eight fields for a body of the wrong shape."""
    errors = exc.errors()
    for error in errors:
        if error.get("type") == "json_invalid":
            return 400, f"malformed JSON body: {error.get('ctx', {}).get('error', error.get('msg'))}"
    parts = []
    for error in errors[:8]:
        location = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
        parts.append(f"{location or 'body'}: {error.get('msg')}")
    return 422, "invalid request body: " + "; ".join(parts)


def route_message(request: Request, exc: StarletteHTTPException) -> str:
    """Starlette's bare "Not Found" / "Method Not Allowed" for a path no route serves, in words."""
    route = f"{request.method} {request.url.path}"
    if exc.status_code == 404 and exc.detail == "Not Found":
        return f"this service has no route {route}: NexRL's TinkerCloud serves the routes of tinker SDK 0.38 (see nexrl_tinker's README)"
    if exc.status_code == 405 and exc.detail == "Method Not Allowed":
        allowed = (exc.headers or {}).get("allow")
        return f"{route} is not served here" + (f"; this path answers {allowed}" if allowed else "")
    return str(exc.detail)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        # A reached limit (429) stays reached when the SDK retries at once: it should not.
        headers = {"x-should-retry": "false"} if isinstance(exc, TooManyRequests) else None
        return JSONResponse({"detail": exc.message}, status_code=exc.status_code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        status, message = validation_message(exc)
        if status != 422:
            return JSONResponse({"detail": message}, status_code=status)
        # ``detail`` is the list of errors FastAPI's schema of a 422 promises; ``message`` says it in words.
        return JSONResponse({"detail": jsonable_encoder(exc.errors()), "message": message}, status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def _no_route(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"detail": route_message(request, exc)}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal_error(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return JSONResponse({"detail": f"internal server error: {type(exc).__name__}: {exc}"}, status_code=500)
