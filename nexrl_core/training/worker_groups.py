"""A training model on a worker group of its own: the seam between a local service and what trains there.

A local Tinker or Weaver service started with ``--workers N`` gives each training model its
own group of N ranks. It names no implementation of those ranks: the one active plugin that
registers ``nexrl_group_engines`` (`nexrl_core.plugins.specs.GroupEngineSpec`) builds `GroupEngines`,
which start each model's `GroupEngine` from a `GroupEngineSetup`; where the ranks run is the
placer's business (`nexrl_core.training.placement`). The records a service hands over (how its groups
start, what it keeps of their restarts) are defined here once, so the service and the plugin
agree on them without importing each other, and the service installs without the plugin.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, cast

import attrs

from nexrl_core.fields import int_tuple
from nexrl_core.http.serving import DEFAULT_MAX_TOKENS_PER_MICROBATCH
from nexrl_core.plugins.registry import Registry, RegistryError, get_registry
from nexrl_core.plugins.specs import GroupEngineSpec, RankCommand
from nexrl_core.training.placement import Placer

__all__ = [
    "GroupEngine",
    "GroupEngineSetup",
    "GroupEngines",
    "GroupHooks",
    "GroupRestart",
    "GroupSettings",
    "NoGroupEngines",
    "open_group_engines",
    "rank_command",
]


@attrs.frozen(kw_only=True)
class GroupSettings:
    """How a service's worker groups are started (the same for every model's group)."""

    ranks: int
    """Ranks (processes) per group."""
    threads_per_rank: int
    """torch threads of each rank (``OMP_NUM_THREADS``)."""
    log_dir: Path
    """Each group's combined output goes to ``<log_dir>/<model id>.log``."""
    placer: Placer
    """Starts each group's ranks (every group of the service, each restart too); its owner closes it."""
    connect_timeout_s: float = 300.0
    """How long a new group may take to start and load the model."""
    op_timeout_s: float = 600.0
    """An op running longer is taken for a hung group (a rank stuck in a collective), which is restarted."""
    heartbeat_s: float = 5.0
    dead_after_s: float = 15.0
    """A group whose ranks stop beating this long is dead, and restarted."""
    save_every: int = attrs.field(default=10, validator=attrs.validators.ge(1))
    """Save the model's state (with the optimizer) every this many optimizer steps, as
    its restart point; the calls since are replayed after a restart, so a larger value
    saves less often but keeps more steps' data and replays more."""
    max_restarts: int = attrs.field(default=3, validator=attrs.validators.ge(0))
    """Restarts one call may cause before it fails (the group keeps dying)."""


@attrs.frozen
class GroupRestart:
    """One restart of a model's group: what was lost, what it came back from, how long it took."""

    reason: str
    restored_from: str | None
    """The restart point loaded; None when the model went back to its initial weights."""
    replayed: int
    """Calls replayed on top of it."""
    seconds: float
    """From noticing the loss to the new group holding the model again."""
    log_tail: str
    """The end of the lost group's output."""


@attrs.frozen(kw_only=True)
class GroupHooks:
    """What the owner of a group engine (a service) keeps of its restarts."""

    autosave_dir: Path | None = None
    """Where the engine saves its restart points and its journal of the calls since; None
    saves none: a restart then goes back to the last save or load the client asked for,
    and a killed owner loses the calls since."""
    on_saved: Callable[[Path], None] = lambda path: None
    """Called with each restart point the engine saved itself."""
    on_restart: Callable[[GroupRestart], None] = lambda restart: None


@attrs.frozen(kw_only=True)
class GroupEngineSetup:
    """One training model's group, as the service asks for it."""

    model_id: str
    training: Any
    """The model to train (base model, LoRA, seed): a `nexrl_engine.config.TrainingSpec`,
    the same record the service's in-process engines are built from."""
    dtype: str
    settings: GroupSettings
    base_sampler: Callable[[], Any]
    """The base model's sampling engine: samplers of this model are built on it from the
    weights the group pushes, so no file is read back."""
    hooks: GroupHooks = attrs.field(factory=GroupHooks)
    gpus: Sequence[int] = attrs.field(default=(), converter=int_tuple)
    """One per rank: the GPUs of this machine its ranks compute on (none: the placer's or the CPU)."""
    max_tokens_per_microbatch: int = DEFAULT_MAX_TOKENS_PER_MICROBATCH
    """Most padded tokens of one forward or forward/backward pass on a rank (the service's)."""


class GroupEngine(Protocol):
    """A training model on its group. Besides these it answers the in-process engine's
    training calls (forward, forward_backward, optim_step, save_state, load_state,
    export_sampler, export_hf) with the same records, so the protocols do not change."""

    def recover(self, path: str | Path | None, with_optimizer: bool = True) -> int:
        """Rebuild the model as its client last saw it, after the service was restarted:
        load the restart point at ``path`` (None: the initial weights), then replay the calls
        journaled after it. Returns how many were replayed."""
        ...

    def sampler(self) -> Any:
        """A sampling engine on the model's current weights, fed from the group."""
        ...

    def stop(self) -> None:
        """End the group (after the call in flight, if any); every rank exits."""
        ...


class GroupEngines(Protocol):
    """What a plugin's `GroupEngineSpec` builds: starts the groups of a service's models."""

    def local_gpus(self) -> int:
        """GPUs of this machine that ranks placed here would compute on (0: the CPU), which
        the service hands out to its groups, one per rank."""
        ...

    def start(self, setup: GroupEngineSetup) -> GroupEngine:
        """Start the model's group and load the model on it.

        :raises nexrl_core.training.placement.PlacementUnavailable: when the cluster has no room for
            the ranks (the service answers 429 and may be asked again).
        """
        ...


class NoGroupEngines(RegistryError):
    """No active plugin trains models on worker groups."""


def _the_group_engines(registry: Registry) -> GroupEngineSpec | None:
    """The one active plugin's `GroupEngineSpec`, or None when no plugin registers one.

    :raises RegistryError: when several do: which one trains is not NexRL's guess.
    """
    names = registry.names("group_engines")
    if len(names) > 1:
        providers = ", ".join(f"{name} (from {registry.providers[('group_engines', name)]})" for name in names)
        raise RegistryError(f"several plugins train models on worker groups: {providers}; disable all but one with NEXRL_DISABLE_PLUGINS")
    if not names:
        return None
    return cast(GroupEngineSpec, registry.find_spec("group_engines", names[0]))


def _none_provides(registry: Registry, what: str, reason: str) -> NoGroupEngines:
    """`NoGroupEngines` for ``what``, with ``reason`` and which plugins are disabled or broken
    (a broken or disabled plugin is the usual reason nothing provides it)."""
    why = [reason]
    broken = [info.name for info in registry.plugins.infos if info.error] + sorted(registry.hook_errors)
    if broken:
        why.append(f"failed to load: {', '.join(broken)}")
    if registry.plugins.disabled:
        why.append(f"disabled by NEXRL_DISABLE_PLUGINS: {', '.join(sorted(registry.plugins.disabled))}")
    return NoGroupEngines(f"no installed plugin provides {what} ({'; '.join(why)})")


def open_group_engines() -> GroupEngines:
    """The group engines of the one active plugin that registers them.

    :raises NoGroupEngines: when none does (saying which plugins are disabled or broken).
    :raises RegistryError: when several do: which one trains is not NexRL's guess.
    """
    registry = get_registry()
    spec = _the_group_engines(registry)
    if spec is None:
        raise _none_provides(registry, "worker groups", "none registers nexrl_group_engines")
    engines: GroupEngines = spec.build()
    return engines


def rank_command() -> RankCommand:
    """How the ranks of the active plugin's worker groups are started by hand, read from its
    `GroupEngineSpec` so that whoever writes such a line names no plugin's module.

    :raises NoGroupEngines: when no plugin registers group engines, or its spec has no
        `RankCommand` (saying which plugins are disabled or broken).
    :raises RegistryError: when several plugins register group engines.
    """
    registry = get_registry()
    spec = _the_group_engines(registry)
    if spec is None:
        raise _none_provides(registry, "worker ranks", "none registers nexrl_group_engines")
    if spec.rank_command is None:
        provider = registry.providers[("group_engines", spec.name)]
        raise _none_provides(registry, "worker ranks", f"the group engines {spec.name!r} of {provider} name no rank command")
    return spec.rank_command
