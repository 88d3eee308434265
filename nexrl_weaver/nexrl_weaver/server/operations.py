"""Weaver's operation envelope, and how a finished operation is stored as an `Outcome`.

Every long call of the SDK is an operation: the submission answers ``{"id",
"status"}`` and the SDK polls ``GET /operations/{id}`` until the status is ``done``
(it then reads ``response``) or ``error`` (it raises ``WeaverOperationError`` from
``error_code``, ``error_message`` and ``error_details``). Only those two statuses are
terminal for the SDK; anything else keeps it polling.

A result with output tensors for an ``http-binary`` client is stored as one blob,
the JSON response and the tensor pack behind it (`PACKED_CONTENT_TYPE`), so both
survive a restart with the future's row.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from nexrl_service.runtime import JSON_CONTENT_TYPE, Outcome

__all__ = ["PACKED_CONTENT_TYPE", "done", "envelope", "packed", "split_result"]

PACKED_CONTENT_TYPE = "application/x-nexrl-weaver-packed"
_LENGTH = struct.Struct(">I")


def done(response: Any) -> Outcome:
    """A finished operation whose ``response`` is plain JSON."""
    return Outcome.json(response)


def packed(response: dict[str, Any], pack: bytes) -> Outcome:
    """A finished operation whose ``response`` names a tensor pack (``response["tensor_pack"]``)."""
    body = json.dumps(response).encode("utf-8")
    return Outcome("done", PACKED_CONTENT_TYPE, _LENGTH.pack(len(body)) + body + pack)


def split_result(outcome: Outcome) -> tuple[Any, bytes | None]:
    """The JSON response of a finished operation, and its tensor pack if it has one."""
    if outcome.content_type == PACKED_CONTENT_TYPE:
        (length,) = _LENGTH.unpack_from(outcome.payload)
        start = _LENGTH.size
        return json.loads(outcome.payload[start : start + length]), outcome.payload[start + length :]
    if outcome.content_type != JSON_CONTENT_TYPE or not outcome.payload:
        return None, None
    return json.loads(outcome.payload), None


def envelope(operation_id: str, outcome: Outcome | None) -> dict[str, Any]:
    """The SDK's view of an operation: pending, done with its response, or an error."""
    if outcome is None:
        return {"id": operation_id, "status": "pending"}
    if outcome.status == "failed":
        stage = "request" if outcome.category == "user" else "server"
        return {
            "id": operation_id,
            "status": "error",
            "error_code": "invalid_request" if outcome.category == "user" else "internal_error",
            "error_message": outcome.error or "the operation failed",
            "error_details": {"operation_id": operation_id, "stage": stage},
            "retryable": False,
        }
    response, _ = split_result(outcome)
    return {"id": operation_id, "status": "done", "response": response}
