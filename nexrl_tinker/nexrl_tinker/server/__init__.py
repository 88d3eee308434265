"""TinkerCloud: a local server speaking the Tinker wire protocol of SDK 0.38.

Only the Tinker wire lives here, on the protocol-independent runtime of
`nexrl_service` (SQL store, futures, scheduler, engine pool, auth, janitor,
uvicorn service). Modules, one job each: `ids` (id and ``tinker://`` path formats),
`codec` (protobuf), `schemas` (JSON bodies), `routes` (a router per resource), `app`
(the routers put together, with the ``tml-`` key policy), the glue that turns bodies
into runtime operations and results into the SDK's shapes (`sessions`, `training`,
`sampling`, `runs`), and `service` (the `TinkerService` that names the protocol).
Requires the ``server`` extra.
"""

from __future__ import annotations

__all__ = ["TinkerService"]


def __getattr__(name: str) -> object:
    if name == "TinkerService":
        from nexrl_tinker.server.service import TinkerService

        return TinkerService
    raise AttributeError(f"module 'nexrl_tinker.server' has no attribute {name!r}")
