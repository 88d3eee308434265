"""The workers' API server (``nexrl serve workers``): the control plane of direct-ZMQ training.

It knows worker groups by identifier (several at once: a student and a teacher group,
say). Per group it binds its own ZMQ PUB socket that every rank subscribes to; it
records each rank's data endpoint, takes heartbeats, and on ``execute`` publishes the
op id to every rank. Training data never passes through it: the driver sends batches
to rank 0 directly. A monitor thread publishes a hello on every group's socket (a rank
waits for one before it reports itself, so no command is published before it
listens) and marks a group dead when a rank stops beating; every driver waiting on
that group learns it from the group's info, with the missing ranks named.

Everything here answers only the run's key (`nexrl_fsdp.direct_zmq.group_key`): every
route but ``/api/v1/healthz`` needs ``Authorization: Bearer <key>`` (a request without it
is answered 401, logged, and nothing of it runs, so nobody else creates, reports into,
executes on or removes a group), and every command published carries a MAC made with
the key, which the ranks check before they act on it. ``nexrl serve workers`` takes the
key from ``--api-key`` or ``NEXRL_WORKER_KEY``; listening beyond the loopback it refuses
to start without one, on the loopback it makes one and prints it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from typing import Any

import attrs
import zmq
from pydantic import BaseModel, ConfigDict, Field

from nexrl_core.http.serving import ServeOptions, ServiceStartError, UvicornServer, base_url_of, listen
from nexrl_core.training.placement import is_loopback
from nexrl_fsdp.direct_zmq.group_key import ENV_WORKER_KEY, bearer_matches, frames_mac, new_group_key
from nexrl_fsdp.direct_zmq.protocol import OPS

__all__ = ["GroupRegistry", "WorkersApiServer"]

logger = logging.getLogger("nexrl_fsdp.workers_api")

ENV_DEAD_AFTER = "NEXRL_WORKER_DEAD_AFTER_S"
"""Seconds without a heartbeat after which a rank counts as dead (default 15)."""
UNUSED_SERVE_OPTIONS = frozenset(
    {"db", "model", "dtype", "device", "data_dir", "workers", "max_worker_groups", "worker_save_every", "max_tokens_per_microbatch"}
)
"""`ServeOptions` fields of other services that mean nothing here."""
_HELLO_EVERY_S = 0.2
OPEN_PATHS = frozenset({"/api/v1/healthz"})
"""The one route anyone may call: it says the server is up and nothing else."""


@attrs.define
class _Group:
    identifier: str
    world_size: int
    publisher: Any
    command_endpoint: str
    endpoints: dict[int, str] = attrs.field(factory=dict)
    pids: dict[int, int] = attrs.field(factory=dict)
    beats: dict[int, float] = attrs.field(factory=dict)
    status: str = "forming"
    """forming (ranks still reporting) → ready → dead or destroyed."""
    reason: str = ""
    failed_ranks: set[int] = attrs.field(factory=set)
    """Ranks that reported their failure or exit; a dead group's reason names each (the
    first is often a peer's broken collective, a later one the cause)."""

    def info(self) -> dict[str, Any]:
        return {
            "identifier": self.identifier,
            "world_size": self.world_size,
            "command_endpoint": self.command_endpoint,
            "endpoints": {str(rank): endpoint for rank, endpoint in sorted(self.endpoints.items())},
            "pids": {str(rank): pid for rank, pid in sorted(self.pids.items())},
            "missing_ranks": [rank for rank in range(self.world_size) if rank not in self.endpoints],
            "status": self.status,
            "reason": self.reason,
        }


class GroupRegistry:
    """Worker groups, their command sockets and their liveness; thread-safe."""

    def __init__(self, host: str, dead_after_s: float, key: str) -> None:
        self.host = host
        self.dead_after_s = dead_after_s
        self.key = key
        self.context = zmq.Context()
        self.groups: dict[str, _Group] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="nexrl-workers-monitor", daemon=True)
        self._monitor.start()

    def create(self, identifier: str, world_size: int) -> dict[str, Any]:
        with self._lock:
            group = self.groups.get(identifier)
            if group is not None and group.status in ("forming", "ready"):
                if group.world_size != world_size:
                    raise ValueError(f"group {identifier!r} exists with world_size {group.world_size}, not {world_size}")
                return group.info()
            if group is not None:
                group.publisher.close(linger=0)
            publisher = self.context.socket(zmq.PUB)
            port = publisher.bind_to_random_port(f"tcp://{self.host}")
            group = _Group(identifier, world_size, publisher, f"tcp://{self.host}:{port}")
            self.groups[identifier] = group
            return group.info()

    def get(self, identifier: str) -> _Group:
        group = self.groups.get(identifier)
        if group is None:
            raise KeyError(f"no worker group {identifier!r}; known: {sorted(self.groups) or 'none'}")
        return group

    def report(self, identifier: str, rank: int, endpoint: str, pid: int) -> dict[str, Any]:
        with self._lock:
            group = self.get(identifier)
            if not 0 <= rank < group.world_size:
                raise ValueError(f"rank {rank} is outside world_size {group.world_size} of group {identifier!r}")
            group.endpoints[rank], group.pids[rank] = endpoint, pid
            group.beats[rank] = time.monotonic()
            if len(group.endpoints) == group.world_size and group.status == "forming":
                group.status = "ready"
            return group.info()

    def beat(self, identifier: str, rank: int) -> str:
        with self._lock:
            group = self.groups.get(identifier)
            if group is None:
                return "unknown"
            if group.status in ("forming", "ready"):
                group.beats[rank] = time.monotonic()
            return group.status

    def fail(self, identifier: str, rank: int, error: str) -> str:
        """A rank's process failed (it says why) or exited (its watchdog says so): the group
        is dead at once, and every rank's report is added to its reason, so every driver
        waiting on it learns the ranks' own errors, not a heartbeat timeout later."""
        with self._lock:
            group = self.groups.get(identifier)
            if group is None:
                return "unknown"
            failure = f"rank {rank} failed: {error}"
            if group.status in ("forming", "ready"):
                group.status = "dead"
                group.reason = failure
                logger.error("worker group %r is dead: %s", group.identifier, group.reason)
            elif group.status == "dead" and rank not in group.failed_ranks:
                group.reason += f"; {failure}"
            group.failed_ranks.add(rank)
            return group.status

    def execute(self, identifier: str, op_id: str, op: str) -> None:
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}; ops: {', '.join(OPS)}")
        with self._lock:
            group = self.get(identifier)
            if group.status != "ready":
                raise RuntimeError(f"worker group {identifier!r} is {group.status}{': ' + group.reason if group.reason else ''}")
            self._publish(group, {"kind": "execute", "op_id": op_id, "op": op})
            if op == "destroy":
                group.status = "destroyed"

    def remove(self, identifier: str) -> None:
        with self._lock:
            group = self.groups.pop(identifier, None)
            if group is not None:
                group.publisher.close(linger=0)

    def _publish(self, group: _Group, message: dict[str, Any]) -> None:
        """Send ``message`` to the group's ranks: the topic, the JSON, and their MAC under
        the key (a rank acts only on a command whose MAC it can check)."""
        frames = [group.identifier.encode(), json.dumps(message).encode()]
        group.publisher.send_multipart([*frames, frames_mac(frames, self.key)])

    def _watch(self) -> None:
        while not self._stop.wait(_HELLO_EVERY_S):
            now = time.monotonic()
            with self._lock:
                for group in self.groups.values():
                    if group.status not in ("forming", "ready"):
                        continue
                    self._publish(group, {"kind": "hello"})
                    silent = {rank: now - beat for rank, beat in group.beats.items() if now - beat > self.dead_after_s}
                    if silent:
                        group.status = "dead"
                        group.reason = "ranks {} stopped beating (last heartbeat {} ago)".format(
                            sorted(silent), ", ".join(f"{age:.1f} s" for _, age in sorted(silent.items()))
                        )
                        logger.error("worker group %r is dead: %s", group.identifier, group.reason)

    def close(self) -> None:
        self._stop.set()
        self._monitor.join(timeout=5)
        with self._lock:
            for group in self.groups.values():
                group.publisher.close(linger=0)
            self.groups.clear()
        self.context.term()


MAX_WORLD_SIZE = 4096
"""Most ranks one group may have: every rank reports, beats and subscribes here, and a
group's info lists its missing ranks, so a number no cluster has would only make the
server allocate until it dies."""
MAX_PID = 2**31 - 1


# Request bodies: pydantic at the HTTP edge only, strict (``true`` is not a rank).
class _Body(BaseModel):
    model_config = ConfigDict(strict=True)


class CreateGroup(_Body):
    identifier: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_.\-]+$")
    world_size: int = Field(ge=1, le=MAX_WORLD_SIZE)


class Report(_Body):
    rank: int = Field(ge=0, lt=MAX_WORLD_SIZE)
    endpoint: str = Field(min_length=1, max_length=512)
    pid: int = Field(ge=0, le=MAX_PID)
    host: str = Field(default="", max_length=255)


class Beat(_Body):
    rank: int = Field(ge=0, lt=MAX_WORLD_SIZE)


class Failure(_Body):
    rank: int = Field(ge=0, lt=MAX_WORLD_SIZE)
    error: str = Field(min_length=1, max_length=4000)


class Execute(_Body):
    op_id: str = Field(min_length=1, max_length=128)
    op: str = Field(min_length=1, max_length=64)


def create_app(registry: GroupRegistry, key: str) -> Any:
    """The FastAPI routes over a registry; bad input is a 4xx naming what is wrong, and a
    request without ``Authorization: Bearer <key>`` (but to `OPEN_PATHS`) is a 401 before
    any route, body parsing included, sees it."""
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.responses import JSONResponse

    app = FastAPI(title="NexRL workers API")

    @app.middleware("http")
    async def require_key(request: Request, call_next: Any) -> Any:
        if request.url.path in OPEN_PATHS or bearer_matches(request.headers.get("authorization"), key):
            return await call_next(request)
        client = f"{request.client.host}:{request.client.port}" if request.client else "an unknown client"
        logger.warning(
            "refused %s %s from %s: no Authorization: Bearer header with the group's key", request.method, request.url.path, client
        )
        return JSONResponse(
            {"detail": f"the workers' API needs the header Authorization: Bearer <key>, with the key its workers have as {ENV_WORKER_KEY}"},
            status_code=401,
            headers={"www-authenticate": "Bearer"},
        )

    def _group(identifier: str) -> Any:
        try:
            return registry.get(identifier)
        except KeyError as error:
            raise HTTPException(404, str(error.args[0])) from None

    @app.get("/api/v1/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/api/v1/groups")
    def create_group(body: CreateGroup) -> dict[str, Any]:
        try:
            return registry.create(body.identifier, body.world_size)
        except ValueError as error:
            raise HTTPException(409, str(error)) from None

    @app.get("/api/v1/groups/{identifier}")
    def group_info(identifier: str) -> dict[str, Any]:
        return _group(identifier).info()

    @app.post("/api/v1/groups/{identifier}/workers")
    def report(identifier: str, body: Report) -> dict[str, Any]:
        _group(identifier)
        try:
            return registry.report(identifier, body.rank, body.endpoint, body.pid)
        except ValueError as error:
            raise HTTPException(422, str(error)) from None

    @app.post("/api/v1/groups/{identifier}/heartbeat")
    def heartbeat(identifier: str, body: Beat) -> dict[str, str]:
        return {"status": registry.beat(identifier, body.rank)}

    @app.post("/api/v1/groups/{identifier}/failed")
    def failed(identifier: str, body: Failure) -> dict[str, str]:
        return {"status": registry.fail(identifier, body.rank, body.error)}

    @app.post("/api/v1/groups/{identifier}/execute")
    def execute(identifier: str, body: Execute) -> dict[str, str]:
        _group(identifier)
        try:
            registry.execute(identifier, body.op_id, body.op)
        except ValueError as error:
            raise HTTPException(422, str(error)) from None
        except RuntimeError as error:
            raise HTTPException(409, str(error)) from None
        return {"status": "published"}

    @app.delete("/api/v1/groups/{identifier}")
    def remove(identifier: str) -> dict[str, str]:
        _group(identifier)
        registry.remove(identifier)
        return {"status": "removed"}

    return app


class WorkersApiServer:
    """The API server as a `nexrl_core.http.serving.Service`: in a background thread, or in the foreground."""

    def __init__(self, options: ServeOptions | None = None, *, key: str | None = None, dead_after_s: float | None = None) -> None:
        """``key`` is the group's key; without one, ``options.api_key`` (``--api-key``), then
        ``NEXRL_WORKER_KEY``, and on the loopback only a new key (`generated_key` says so;
        `serve_forever` prints it for the workers).

        :raises ServiceStartError: for a `ServeOptions` field the API server has no use
            for (it keeps no database or files, loads no model: the workers do), so ``nexrl
            serve workers --db ...`` is refused rather than ignored; and for a ``host``
            beyond the loopback without a key, which would let whoever reaches the port
            drive the workers.
        """
        self.options = options or ServeOptions()
        unused = [
            f"--{field.name.replace('_', '-')}"
            for field in attrs.fields(ServeOptions)
            if field.name in UNUSED_SERVE_OPTIONS and getattr(self.options, field.name) != field.default
        ]
        if unused:
            raise ServiceStartError(
                f"{', '.join(unused)}: the workers' API server keeps no database or files, loads no model (the workers "
                "load the one a run's init_model names); leave them out"
            )
        key = key or self.options.api_key or os.environ.get(ENV_WORKER_KEY) or None
        self.generated_key = key is None
        """Whether no key was given and this server made its own (on the loopback only)."""
        if key is None and not is_loopback(self.options.host):
            raise ServiceStartError(
                f"--host {self.options.host} is reachable from other machines, so the workers' API needs a key: pass --api-key KEY "
                f"or set {ENV_WORKER_KEY} (the ranks and the driver get the same key as {ENV_WORKER_KEY})",
                option="api_key",
            )
        self.key = key or new_group_key()
        """The key every request (but the health check) and every command is checked with."""
        if dead_after_s is None:
            dead_after_s = float(os.environ.get(ENV_DEAD_AFTER, "15"))
        self.dead_after_s = dead_after_s
        self.registry: GroupRegistry | None = None
        self.base_url: str | None = None
        self._server: UvicornServer | None = None
        self._socket: socket.socket | None = None

    def _prepare(self) -> UvicornServer:
        try:
            self._socket = listen(self.options.host, self.options.port)
        except OSError as error:
            raise RuntimeError(f"cannot listen on {self.options.host}:{self.options.port}: {error}") from error
        self.base_url = base_url_of(self._socket)
        self.registry = GroupRegistry(self.options.host, self.dead_after_s, self.key)
        self._server = UvicornServer(create_app(self.registry, self.key), self._socket, name="nexrl-workers-api")
        return self._server

    def start(self) -> str:
        server = self._prepare()
        try:
            server.start("the workers API server", timeout_s=30)
        except RuntimeError:
            self.stop()
            raise
        assert self.base_url is not None
        return self.base_url

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(timeout_s=10)
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        if self.registry is not None:
            self.registry.close()
            self.registry = None

    def failure(self) -> str | None:
        if self._server is not None and self._server.thread_died():
            return f"the workers API server at {self.base_url} stopped: its thread exited"
        return None

    def serve_forever(self) -> None:
        server = self._prepare()
        if self.generated_key:
            print(
                f"NexRL workers API: no key given, so it made one; give it to the workers and the driver as {ENV_WORKER_KEY}={self.key}",
                file=sys.stderr,
                flush=True,
            )
        print(f"NexRL workers API serving at {self.base_url}", file=sys.stderr, flush=True)
        try:
            server.run()
        except (KeyboardInterrupt, SystemExit):
            pass
        finally:
            self._server = None
            self.stop()
