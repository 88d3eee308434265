"""Start a worker group for one run (API server + ranks placed by a placer) and end it again.

`WorkerGroup` is what the self-hosted backend, the local services' worker groups and the
tests use: an API server in a thread of this process, listening where every rank the
placer starts can reach it (`nexrl_core.training.placement.Placer.control_host`: 127.0.0.1 for
the ``local`` placer), ``python -m nexrl_fsdp.worker`` placed once per rank, and a
connected transport. Ranks also exit on their own when the API server goes away, so
nothing outlives the run. Each group has a key of its own (`group_key`), which its API
server, its ranks (through their environment) and its transport check. Several groups
may share one API server (a student and its teacher): the caller starts the server and
gives it to each, and each group then stops its own ranks, not the server.
"""

from __future__ import annotations

from pathlib import Path

from nexrl_core.http.serving import ServeOptions
from nexrl_core.training.placement import PlacedRanks, PlacementRequest, Placer, RankPlace, log_tail
from nexrl_fsdp.direct_zmq.api_server import WorkersApiServer
from nexrl_fsdp.direct_zmq.group_key import ENV_WORKER_KEY, new_group_key
from nexrl_fsdp.direct_zmq.protocol import ENV_HEARTBEAT_INTERVAL
from nexrl_fsdp.direct_zmq.transport import DirectZmqOptions, DirectZmqTransport, WorkerGroupError
from nexrl_fsdp.local_placer import LocalPlacer

__all__ = ["WorkerGroup"]

_STOP_TIMEOUT_S = 15.0


class WorkerGroup:
    """An API server, ``nproc`` worker ranks where ``placer`` puts them, and a transport to them."""

    def __init__(
        self,
        nproc: int,
        log_path: Path,
        *,
        placer: Placer | None = None,
        identifier: str = "actor",
        heartbeat_s: float = 5.0,
        dead_after_s: float = 15.0,
        connect_timeout_s: float = 180.0,
        op_timeout_s: float = 600.0,
        extra_env: dict[str, str] | None = None,
        key: str | None = None,
        cpus_per_rank: float = 1.0,
        server: WorkersApiServer | None = None,
    ) -> None:
        """``placer`` starts the ranks (this machine's loopback when None; the caller
        closes a placer it passes). ``key`` is the group's key; a new one
        (`new_group_key`) when None. A caller passes its own when a process it started
        before the group (a sampler the ranks push weights to) must hold the same key.
        ``server`` is a started API server the group registers on (its key must be
        ``key``; its ``dead_after_s`` applies, and the caller stops it); None starts one
        of the group's own, stopped with it.

        :raises nexrl_core.training.placement.PlacementError: when the placer cannot start the
            ranks (`PlacementUnavailable`: no room for them in time).
        :raises WorkerGroupError: when they start but do not all report in time.
        """
        self.nproc = nproc
        self.log_path = Path(log_path)
        self.placer = placer or LocalPlacer()
        self.key = key or new_group_key()
        self.identifier = identifier
        self._owns_server = server is None
        if server is None:
            server = WorkersApiServer(ServeOptions(host=self.placer.control_host(), port=0), key=self.key, dead_after_s=dead_after_s)
            server.start()
        self.server = server
        assert server.base_url is not None, "a shared API server is started by the caller"
        url = server.base_url
        self.placed: PlacedRanks | None = None
        self._transport: DirectZmqTransport | None = None
        try:
            self.placed = self.placer.place(
                PlacementRequest(
                    group=identifier,
                    ranks=nproc,
                    command=["-m", "nexrl_fsdp.worker", "--api-server-url", url, "--identifier", identifier],
                    env={ENV_HEARTBEAT_INTERVAL: str(heartbeat_s), **(extra_env or {}), ENV_WORKER_KEY: self.key},
                    cpus_per_rank=cpus_per_rank,
                    log_path=self.log_path,
                )
            )
            self._transport = DirectZmqTransport(
                DirectZmqOptions(
                    api_server_url=url,
                    key=self.key,
                    identifier=identifier,
                    world_size=nproc,
                    connect_timeout_s=connect_timeout_s,
                    op_timeout_s=op_timeout_s,
                    log_path=str(self.log_path),
                )
            )
            self._transport.initialize_worker()
        except BaseException:
            self.stop()
            raise

    @property
    def transport(self) -> DirectZmqTransport:
        """The transport to the ranks, connected from the end of ``__init__`` until `stop`."""
        assert self._transport is not None, "the group was stopped"
        return self._transport

    def rank_pids(self) -> dict[int, int]:
        """Each rank's process id, as the rank reported it."""
        return {int(rank): pid for rank, pid in self.transport.info()["pids"].items()}

    def places(self) -> list[RankPlace]:
        """Where each rank runs (node, address, device), as the placer put it."""
        return self.placed.places() if self.placed is not None else []

    def ended(self) -> bool:
        """Whether a rank's process (and so the whole group) has exited, or the group was stopped."""
        return self.placed is None or self.placed.ended()

    def stop(self) -> None:
        """Destroy the group if it still answers, then end its ranks and the server."""
        transport = self._transport
        if transport is not None and self.placed is not None and not self.placed.ended():
            try:
                transport.destroy()
            except WorkerGroupError:
                pass
        if self.placed is not None:
            self.placed.stop(grace_s=_STOP_TIMEOUT_S if transport is not None else 0.1)
            self.placed = None
        if transport is not None:
            transport.close()
            self._transport = None
        if self._owns_server:
            self.server.stop()
        elif self.server.registry is not None:  # a shared server forgets this group, and lives on
            self.server.registry.remove(self.identifier)

    def log_tail(self, limit: int = 4000) -> str:
        """The end of the workers' combined output (for error messages)."""
        return log_tail(self.log_path, limit)
