"""Where a worker group's ranks run: the placement seam.

Everything that starts the ranks of a worker group (a self-hosted run, a local Tinker or
Weaver service with ``--workers N``) asks a `Placer` for them, so a cluster manager is a
plugin and not a change to NexRL. A plugin registers placers with ``nexrl_placers``
(`nexrl_core.plugins.specs.PlacerSpec`): its factory takes the placer's options and returns a
`Placer`; the caller names one (``--placement NAME``, ``backend.options.placement``).

A placer starts one process per rank, ``python <command>``, with the command's own
environment plus torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``; ``MASTER_ADDR`` and ``MASTER_PORT`` are rank 0's node and a port
free on it, the rendezvous), so any ``torch.distributed`` program runs under any placer,
and `ENV_RANK_ADDRESS`. It watches the processes and stops them. It knows nothing of what the ranks do: they find the driver through the
URL their command carries.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs

from nexrl_core.fields import string_tuple

__all__ = [
    "ENV_RANK_ADDRESS",
    "LOCAL_PLACEMENT",
    "PlacedRanks",
    "PlacementError",
    "PlacementRequest",
    "PlacementUnavailable",
    "Placer",
    "RankPlace",
    "is_loopback",
    "log_tail",
    "open_placer",
]

ENV_RANK_ADDRESS = "NEXRL_WORKER_IP"
"""Set by every placer on every rank: the address of the rank's node that the other ranks
and the driver reach it at, where a rank binds the sockets it serves."""

LOCAL_PLACEMENT = "local"
"""The placer of ranks on this machine (every socket on the loopback): what places a group
whose caller names no placer. The plugin that starts ranks here registers it under this name."""


class PlacementError(RuntimeError):
    """The ranks could not be started (the message says what was asked and why it failed)."""


class PlacementUnavailable(PlacementError):
    """The cluster has no room for the ranks within the placer's deadline: nothing was
    left behind, and asking again later may succeed (a service answers 429)."""


@attrs.frozen(kw_only=True)
class PlacementRequest:
    """One worker group's ranks, as the caller asks for them."""

    group: str = attrs.field(validator=attrs.validators.matches_re(r"^[A-Za-z0-9_.\-]{1,200}$"))
    """The group's name: placers name what they create after it, so an operator can tell whose it is."""
    ranks: int = attrs.field(validator=attrs.validators.ge(1))
    command: Sequence[str] = attrs.field(converter=string_tuple)
    """Each rank runs ``python <command>`` (e.g. ``-m package.module --flag value``)."""
    env: Mapping[str, str] = attrs.field(factory=dict)
    """Added to each rank's environment (a secret travels here, never on a command line)."""
    cpus_per_rank: float = attrs.field(default=1.0, validator=attrs.validators.gt(0))
    gpus_per_rank: int | None = None
    """GPUs each rank needs; None lets the placer decide (one per rank where it has
    GPUs, none on CPU nodes)."""
    log_path: Path
    """Where every rank's output goes (on each rank's own node)."""


@attrs.frozen
class RankPlace:
    """Where one rank landed."""

    rank: int
    node: str
    """The node's name as the placer knows it (a hostname, a Ray node id)."""
    address: str
    """The address of the rank's node (`ENV_RANK_ADDRESS`)."""
    device: str
    """``cpu``, or the GPU the rank computes on (``cuda:0``, as its node numbers it)."""


class PlacedRanks(Protocol):
    """A group's running ranks, as one placer started them."""

    def places(self) -> list[RankPlace]:
        """Where each rank landed, in rank order."""
        ...

    def ended(self) -> bool:
        """Whether any rank's process (or whatever hosts it) is gone: the group is lost."""
        ...

    def stop(self, grace_s: float = 15.0) -> None:
        """Wait up to ``grace_s`` for the ranks to exit on their own (a destroyed group's
        do), then end them and release what was reserved for them; safe to call twice."""
        ...

    def log_tail(self, limit: int = 4000) -> str:
        """The end of the ranks' output that this process can read (for error messages)."""
        ...


class Placer(Protocol):
    """Starts the ranks of worker groups on some set of machines."""

    def control_host(self) -> str:
        """The address of this process that every rank it places can reach: the driver
        serves the group's control plane there (loopback for ranks on this machine only)."""
        ...

    def place(self, request: PlacementRequest) -> PlacedRanks:
        """Start ``request.ranks`` processes.

        :raises PlacementUnavailable: when there is no room for them within the placer's
            deadline (naming what was asked and what is free); nothing is left behind.
        :raises PlacementError: when they cannot be started at all.
        """
        ...

    def close(self) -> None:
        """Let go of the cluster (a connection, a client); the cluster itself is left as it was."""
        ...


def open_placer(name: str, options: Mapping[str, Any], path: str) -> Placer:
    """The placer registered as ``name``, its ``options`` structured into its config class.

    :param path: where the choice was made (``backend.options.placement``), named in errors.
    :raises nexrl_core.config.errors.ConfigError: for a placer no installed plugin
        registers (naming the extra that brings it, where one does) or a bad option.
    """
    from nexrl_core.config.components import resolve_options
    from nexrl_core.config.schema import ComponentChoice
    from nexrl_core.plugins.registry import find_spec

    config = resolve_options("placers", ComponentChoice(name=name, options=dict(options)), path)
    placer: Placer = find_spec("placers", name).build(config)
    return placer


def log_tail(path: Path, limit: int = 4000) -> str:
    """The last ``limit`` characters of the ranks' log at ``path`` ("" when there is none
    yet): what an error about a group quotes of its output."""
    try:
        return Path(path).read_text(errors="replace")[-limit:]
    except OSError:
        return ""


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only: a placer whose control host is
    one placed every rank here, and a server bound on one needs no key to keep others out
    (a name other than ``localhost`` may resolve anywhere, so it counts as reachable)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
