"""TinkerCloud's routes, one `fastapi.APIRouter` per resource of SDK 0.38's API.

Each module's ``router`` takes the service object it is thin over and the ``owner``
dependency (the caller's tenant from ``X-API-Key``, see `nexrl_tinker.server.app`):
`client` (bootstrap, health, capabilities, the hosted-only reports refused),
`sessions`, `training`, `sampling`, `futures` (the long-poll) and `runs` (training
runs, checkpoints, weight copies). `errors` turns every failure into the JSON body the
SDK reads. Handlers parse and authenticate, then call a service; most are plain
functions, which FastAPI runs on its thread pool, because they touch SQL.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

__all__ = ["Owner"]

Owner = Callable[..., Awaitable[str]]
"""The dependency that authenticates a request and gives its tenant."""
