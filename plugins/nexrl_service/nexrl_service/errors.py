"""Errors with an HTTP status and a message a client can show.

Every protocol served on the runtime has the same two kinds of failure:

* `ApiError`: the HTTP request itself is refused (bad body, unknown id, wrong key,
  another tenant's resource). A protocol's routes turn it into a 4xx whose body
  carries the message, never an empty body (SDKs retry what looks like a proxy's
  rejection).
* `RequestFailed`: an accepted request (a future, or an operation in protocols that
  call it so) failed. The scheduler stores it as the future's outcome, and the
  protocol answers it in its own shape when the client polls.
"""

from __future__ import annotations

__all__ = [
    "ApiError",
    "BadRequest",
    "Forbidden",
    "Gone",
    "NotFound",
    "RequestFailed",
    "TooManyRequests",
    "Unauthorized",
    "Unprocessable",
]


class ApiError(Exception):
    """A refused HTTP request; subclasses fix the status code."""

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


class TooManyRequests(ApiError):
    """A limit of the service is reached (the message names it); retrying the same
    request does not help until something is released, so protocols tell clients not to."""

    status_code = 429


class RequestFailed(Exception):
    """A future's failure; ``category`` is ``user`` (fix the request) or ``server``."""

    def __init__(self, message: str, category: str = "user") -> None:
        super().__init__(message)
        self.message = message
        self.category = category
