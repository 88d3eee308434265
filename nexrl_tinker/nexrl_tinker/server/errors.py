"""Errors with an HTTP status and a message the SDK can show.

Two kinds of failure exist in the Tinker protocol:

* `ApiError`: the HTTP request itself is refused (bad body, unknown id, wrong key,
  another tenant's resource). It becomes a 4xx with a JSON ``{"detail": message}``
  body, never an empty one: the SDK takes an empty 400 for a Cloudflare rejection
  and retries it.
* `RequestFailed`: an accepted request (a future) failed. ``retrieve_future``
  answers HTTP 200 ``{"error": message, "category": "user"|"server"}``, which the SDK
  raises as ``tinker.RequestFailedError``.
"""

from __future__ import annotations

__all__ = [
    "ApiError",
    "BadRequest",
    "Forbidden",
    "Gone",
    "NotFound",
    "RequestFailed",
    "Unauthorized",
    "Unprocessable",
]


class ApiError(Exception):
    status_code = 400

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequest(ApiError):
    status_code = 400


class Unauthorized(ApiError):
    status_code = 401


class Forbidden(ApiError):
    status_code = 403


class NotFound(ApiError):
    status_code = 404


class Gone(ApiError):
    status_code = 410


class Unprocessable(ApiError):
    status_code = 422


class RequestFailed(Exception):
    """A future's failure; ``category`` is ``user`` (fix the request) or ``server``."""

    def __init__(self, message: str, category: str = "user") -> None:
        super().__init__(message)
        self.message = message
        self.category = category
