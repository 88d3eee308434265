"""Options of the ``direct-zmq`` transport; light to import (no torch, no zmq)."""

from __future__ import annotations

import attrs

__all__ = ["DirectZmqOptions"]


@attrs.frozen(kw_only=True)
class DirectZmqOptions:
    """Where the worker group is, the key it answers, and how long to wait for it."""

    api_server_url: str
    key: str = attrs.field(repr=False)
    """The group's key (`nexrl_fsdp.direct_zmq.group_key`): the bearer token of every call
    to the API server and the key of every message's MAC to and from rank 0. Required:
    a group answers nobody without it. Left out of the repr, so logs do not show it."""
    identifier: str = "actor"
    world_size: int = 1
    connect_timeout_s: float = 120.0
    """How long `initialize_worker` waits for every rank to report its endpoint."""
    op_timeout_s: float = 600.0
    """How long one op may take (ACK plus execution)."""
    total_timeout_s: float | None = None
    """A cap on the time of all ops together (None: no cap)."""
    log_path: str | None = None
    """Where the ranks' output goes, when the driver knows (a group it started): errors name it."""
