"""A local server speaking the Weaver wire protocol of nex-weaver 1.19.

Only the Weaver wire lives here, on the protocol-independent runtime of
`nexrl_service` (SQL store, futures, scheduler, engine pool, auth, janitor,
uvicorn service). Modules, one job each: `ids` (ids and ``weaver://`` paths),
`bodies` (fields read from the SDK's JSON), `tensors` (JSON tensors, the
``http-binary`` multipart packs and result packs), `operations` (the operation
envelope and how a finished operation is stored), `training`, `sampling` and
`sessions` (the SDK's bodies in, runtime operations, the SDK's shapes out),
`artifacts` (HF exports and their signed downloads), `routes` (a router per
resource, Weaver's JSON error bodies, the OpenAPI schemas), `app` (the routers put
together, with the key policy) and `service` (the `WeaverService` that names the
protocol). Requires the ``server`` extra.
"""

from __future__ import annotations

__all__ = ["WeaverService"]


def __getattr__(name: str) -> object:
    if name == "WeaverService":
        from nexrl_weaver.server.service import WeaverService

        return WeaverService
    raise AttributeError(f"module 'nexrl_weaver.server' has no attribute {name!r}")
