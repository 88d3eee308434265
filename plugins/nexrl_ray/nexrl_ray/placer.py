"""The ``ray`` placer: a worker group's ranks on a Ray cluster.

One placement group per worker group, one bundle per rank (``{CPU: c, GPU: g}`` plus any
custom resources the options name), so Ray reserves the whole group or nothing, and
the group's ranks are packed onto as few nodes as fit (``PACK``) or spread (``SPREAD``).
In each bundle a `RankHost` actor starts the rank's process with torchrun's environment:
rank 0's node and a port free on it are the rendezvous (``MASTER_ADDR``,
``MASTER_PORT``), each rank binds its own sockets on its node's address
(``NEXRL_WORKER_IP``), and the process-group backends are the ranks' own choice (NCCL
on GPUs, gloo on CPUs), as under any other placer.

What this process creates it removes: stopping a group kills its actors (which end their
ranks) and removes its placement group, and a group Ray cannot place within the
deadline is removed before the refusal is raised. Actors and placement groups belong to
this process's Ray job, so Ray removes them too when this process dies. The cluster
itself (``ray start``) is never started or stopped here.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from nexrl_core.training.placement import ENV_RANK_ADDRESS, PlacementError, PlacementRequest, PlacementUnavailable, RankPlace, log_tail
from nexrl_ray.options import RayPlacerOptions
from nexrl_ray.rank_host import RankHost

__all__ = ["NAMESPACE", "RayPlacer", "RayRanks"]

log = logging.getLogger("nexrl_ray")

NAMESPACE = "nexrl"
"""The Ray namespace this process joins when it connects (placement groups and actors
are named ``nexrl-<group>-<id>`` in it)."""
_POLL_S = 0.2
_ASK_TIMEOUT_S = 10.0
"""How long a question to a rank's actor may take before the actor counts as unreachable."""

_connection_lock = threading.Lock()
_connections = 0
_connected_here = False


def _connect(address: str | None) -> None:
    """Join the Ray cluster once per process (placers share the connection)."""
    global _connections, _connected_here
    import ray

    with _connection_lock:
        if not ray.is_initialized():
            target = address or os.environ.get("RAY_ADDRESS") or "auto"
            try:
                _check_reachable(target)
                ray.init(address=target, namespace=NAMESPACE, log_to_driver=False, configure_logging=False)
            except (ConnectionError, RuntimeError, OSError) as error:
                raise PlacementError(
                    f"no Ray cluster at {target!r} ({error}); start one with `ray start --head` on one node and "
                    "`ray start --address HEAD:6379` on the others, or give its address (--placement-option address=HOST:PORT, "
                    "placement_options.address, RAY_ADDRESS)"
                ) from None
            _connected_here = True
        _connections += 1


def _check_reachable(target: str) -> None:
    """Fail at once on a ``HOST:PORT`` nothing listens on: Ray itself would retry for minutes.

    :raises OSError: naming why the address cannot be reached.
    """
    if target == "auto" or "://" in target or ":" not in target:
        return
    host, _, port = target.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=_ASK_TIMEOUT_S):
        pass


def _disconnect() -> None:
    global _connections, _connected_here
    import ray

    with _connection_lock:
        _connections = max(0, _connections - 1)
        if _connections == 0 and _connected_here:
            ray.shutdown()
            _connected_here = False


class RayRanks:
    """One group's placement group, its rank actors and where each rank landed."""

    def __init__(self, placement_group: Any, actors: list[Any], places: list[RankPlace], log_path: Path) -> None:
        self.placement_group = placement_group
        self.actors = actors
        self._places = places
        self.log_path = log_path
        self._stopped = False

    def places(self) -> list[RankPlace]:
        return list(self._places)

    def _exit_codes(self) -> list[int | None] | None:
        """Each rank's exit status (None while it runs); None when an actor is gone."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            return ray.get([actor.exit_code.remote() for actor in self.actors], timeout=_ASK_TIMEOUT_S)
        except RayActorError:
            return None
        except GetTimeoutError:
            return [None] * len(self.actors)  # a node that does not answer is found by its ranks' silence

    def ended(self) -> bool:
        if self._stopped:
            return True
        codes = self._exit_codes()
        return codes is None or any(code is not None for code in codes)

    def stop(self, grace_s: float = 15.0) -> None:
        """Wait up to ``grace_s`` for the ranks to exit on their own (a destroyed group's
        do), then end them, kill their actors and remove the placement group."""
        if self._stopped:
            return
        self._stopped = True
        import ray
        from ray.util.placement_group import remove_placement_group

        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            codes = self._exit_codes()
            if codes is None or all(code is not None for code in codes):
                break
            time.sleep(_POLL_S)
        stopping = [actor.stop.remote() for actor in self.actors]
        ray.wait(stopping, num_returns=len(stopping), timeout=_ASK_TIMEOUT_S + 15)
        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - an actor already gone is what we want
                pass
        try:
            remove_placement_group(self.placement_group)
        except Exception as error:  # noqa: BLE001 - logged; Ray removes it with this job anyway
            log.warning("could not remove placement group %s: %s", self.placement_group.id, error)

    def log_tail(self, limit: int = 4000) -> str:
        """The end of the log of the ranks on this node (ranks elsewhere write theirs on their node)."""
        return log_tail(self.log_path, limit)


class RayPlacer:
    """Places each worker group on the Ray cluster the options name."""

    def __init__(self, options: RayPlacerOptions | None = None) -> None:
        self.options = options or RayPlacerOptions()
        _connect(self.options.address)
        self._closed = False

    def control_host(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def _bundle(self, request: PlacementRequest) -> dict[str, float]:
        import ray

        gpus = request.gpus_per_rank
        if gpus is None:
            gpus = 1 if ray.cluster_resources().get("GPU", 0) > 0 else 0
        return {"CPU": float(request.cpus_per_rank), **({"GPU": float(gpus)} if gpus else {}), **self.options.resources_per_rank}

    def place(self, request: PlacementRequest) -> RayRanks:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self._bundle(request)
        name = f"nexrl-{request.group}-{uuid.uuid4().hex[:8]}"
        group = placement_group([dict(bundle) for _ in range(request.ranks)], strategy=self.options.strategy, name=name)
        ready, _ = ray.wait([group.ready()], timeout=self.options.place_timeout_s)
        if not ready:
            remove_placement_group(group)
            raise PlacementUnavailable(self._no_room(request, bundle))
        host = ray.remote(RankHost)
        # Handles, as the rest of this module holds them: Ray types one as `ActorHandle[T] | type[T]`,
        # whose methods have no ``.remote`` unless each is decorated with `ray.method`.
        actors: list[Any] = []
        try:
            for index in range(request.ranks):
                actors.append(
                    host.options(
                        name=f"{name}-rank{index}",
                        num_cpus=bundle["CPU"],
                        num_gpus=bundle.get("GPU", 0),
                        resources={key: value for key, value in bundle.items() if key not in ("CPU", "GPU")},
                        scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
                    ).remote()
                )
            where = ray.get([actor.where.remote() for actor in actors], timeout=self.options.place_timeout_s)
            port = ray.get(actors[0].free_port.remote(), timeout=_ASK_TIMEOUT_S)
            places = self._start(request, actors, where, port)
        except BaseException as error:
            RayRanks(group, actors, [], Path(request.log_path)).stop(grace_s=0)
            if isinstance(error, Exception) and not isinstance(error, PlacementError):
                raise PlacementError(f"could not start the ranks of group {request.group!r} on Ray: {error}") from error
            raise
        log.info(
            "group %s placed on Ray as %s: %s",
            request.group,
            name,
            ", ".join(f"rank {p.rank} on {p.node[:12]} ({p.address})" for p in places),
        )
        return RayRanks(group, actors, places, Path(request.log_path))

    def _start(self, request: PlacementRequest, actors: list[Any], where: list[tuple[str, str, list[str]]], port: int) -> list[RankPlace]:
        """Start each rank with torchrun's environment, rank 0's node the rendezvous."""
        import ray

        master = where[0][1]
        nodes = [node for node, _, _ in where]
        places, starts = [], []
        for rank, (actor, (node, address, gpus)) in enumerate(zip(actors, where)):
            local_rank = nodes[:rank].count(node)
            env = {
                **request.env,
                "RANK": str(rank),
                # Ray shows each actor only its own GPUs, so a rank's device is always its first.
                "LOCAL_RANK": "0" if gpus else str(local_rank),
                "WORLD_SIZE": str(request.ranks),
                "LOCAL_WORLD_SIZE": str(nodes.count(node)),
                "GROUP_RANK": str(list(dict.fromkeys(nodes)).index(node)),
                "MASTER_ADDR": master,
                "MASTER_PORT": str(port),
                ENV_RANK_ADDRESS: address,
            }
            starts.append(actor.start.remote(list(request.command), env, str(request.log_path)))
            places.append(RankPlace(rank, node, address, f"cuda:{gpus[0]}" if gpus else "cpu"))
        ray.get(starts, timeout=_ASK_TIMEOUT_S)
        return places

    def _no_room(self, request: PlacementRequest, bundle: dict[str, float]) -> str:
        import ray

        free, total = ray.available_resources(), ray.cluster_resources()
        shown = ", ".join(f"{key} {free.get(key, 0):g} of {total.get(key, 0):g}" for key in bundle)
        return (
            f"Ray could not place worker group {request.group!r} within {self.options.place_timeout_s:g} s: it asks for "
            f"{request.ranks} rank{'s' if request.ranks != 1 else ''} of {_shown(bundle)} ({self.options.strategy}), and the "
            f"cluster has free {shown}; wait for other groups to end, add nodes, or ask for fewer ranks"
        )

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            _disconnect()


def _shown(bundle: dict[str, float]) -> str:
    return "{" + ", ".join(f"{key}: {value:g}" for key, value in bundle.items()) + "}"
