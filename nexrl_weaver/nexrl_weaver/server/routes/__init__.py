"""The local Weaver service's routes, one `fastapi.APIRouter` per resource of
nex-weaver 1.19's API.

Each module's ``router`` takes the service object it is thin over, the ``owner``
dependency (the caller's tenant from ``X-WEAVER-API-KEY``, see
`nexrl_weaver.server.app`) and the `Bodies` below: `catalogue` (health, capabilities,
models), `sessions`, `models` (training), `artifacts` (HF exports), `sampling` and
`operations` (the long-poll). `errors` writes every failure as Weaver's JSON body and
`schemas` describes the bodies read by hand, for the OpenAPI schema.

Operations answer as envelopes (`nexrl_weaver.server.operations.envelope`): a
submission waits up to ``submit_wait_s`` for its result, so a quick operation needs no
poll, and otherwise answers ``pending`` long before the SDK's 60 s read timeout (a
timed-out POST is re-sent); ``GET /operations/{id}`` holds up to ``long_poll_s``.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
from fastapi import Request
from fastapi.concurrency import run_in_threadpool

from nexrl_service.runtime import BadRequest, ServiceState
from nexrl_weaver.server.operations import envelope

__all__ = ["Bodies", "Owner"]

Owner = Callable[..., Awaitable[str]]
"""The dependency that authenticates a request and gives its tenant."""


@attrs.frozen
class Bodies:
    """Reads a route's JSON body by hand (the Weaver wire's shapes vary with the SDK's
    options) and answers a submission as an envelope."""

    state: ServiceState

    async def json(self, request: Request, *, optional: bool = False) -> dict[str, Any]:
        """The body as a JSON object, refused in words when too large, empty where one is
        needed, malformed or not an object."""
        limit = self.state.settings.max_body_bytes
        raw = await request.body()
        if len(raw) > limit:
            raise BadRequest(f"request body is larger than {limit} bytes")
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

    async def submitted(self, submit: Callable[..., str], *args: Any) -> dict[str, Any]:
        """Run a submission, then wait briefly for its result (see the module docstring)."""
        book = self.state.book
        operation_id = await run_in_threadpool(submit, *args)
        outcome = await book.wait(operation_id, self.state.settings.submit_wait_s)
        if outcome is not None:
            book.note_fetched(operation_id)
        return envelope(operation_id, outcome)
