"""Every failure as Weaver's JSON error body ``{"error", "message", "retryable"}``, a
4xx for bad input, never an empty body."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from nexrl_service.runtime import ApiError

__all__ = ["error", "install_error_handlers"]

log = logging.getLogger("nexrl_weaver.server")

ERROR_CODES = {
    400: "invalid_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    410: "gone",
    422: "invalid_request",
    429: "limit_reached",
    501: "not_supported",
}


def error(status: int, message: str, headers: Mapping[str, str] | None = None, **extra: Any) -> JSONResponse:
    return JSONResponse(
        {"error": ERROR_CODES.get(status, "error" if status < 500 else "internal_error"), "message": message, "retryable": False, **extra},
        status_code=status,
        headers=headers,
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return error(exc.status_code, exc.message)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        # ``detail`` is the list FastAPI's schema of a 422 promises; ``message`` Weaver's text.
        return error(422, f"invalid request: {exc.errors()[:4]}", detail=jsonable_encoder(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error(exc.status_code, str(exc.detail), exc.headers)  # a 405 keeps its Allow header

    @app.exception_handler(Exception)
    async def _internal_error(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return error(500, f"internal server error: {type(exc).__name__}: {exc}")
