"""TinkerCloud: a local server speaking the Tinker wire protocol of SDK 0.38.

Modules, one job each: `settings` (options), `store` (SQL state), `auth` (API keys),
`ids` (id and path formats), `codec` (protobuf), `futures` (accepted requests and
long-polls), `scheduler` (ordered execution on threads), `engines` (which engine
serves what), `cloud` (the shared state and housekeeping), `sessions`, `training`,
`sampling`, `runs` (the operations), `schemas` (JSON bodies), `app` (routes) and
`service` (the `TinkerService` that runs it). Requires the ``server`` extra.
"""

from __future__ import annotations

__all__ = ["TinkerService"]


def __getattr__(name: str) -> object:
    if name == "TinkerService":
        from nexrl_tinker.server.service import TinkerService

        return TinkerService
    raise AttributeError(f"module 'nexrl_tinker.server' has no attribute {name!r}")
