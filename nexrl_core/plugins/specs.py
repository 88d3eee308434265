"""Spec records that registration hooks return.

A spec names one implementation and says how to build it, without building it: the
factory is resolved and called only when a run chooses the name, so importing a plugin
module stays cheap even when the implementation needs torch or a network SDK.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Union

import attrs

from nexrl_core.fields import string_frozenset

Factory = Union[str, Callable[..., Any]]
"""A callable that builds the implementation from its config, or a ``"module:attr"``
reference to one, imported on first use."""


def _no_options() -> type:
    return NoOptions


@attrs.frozen
class NoOptions:
    """Config class for implementations that take no options."""


@attrs.frozen(kw_only=True)
class ComponentSpec:
    """What every registered component declares.

    The factory is called as ``factory(config)`` with an instance of ``config_class``.
    """

    kind: ClassVar[str] = "component"

    name: str = attrs.field(validator=attrs.validators.matches_re(r"^[a-z0-9][a-z0-9_.\-]*$"))
    """Name users write in config, e.g. ``grpo``. Lower case; third parties may namespace
    it with a dot (``acme.median``)."""
    factory: Factory
    """Builds the implementation; heavy imports belong inside it."""
    config_class: type = attrs.field(factory=_no_options)
    """attrs class holding the implementation's options; YAML is structured into it."""
    description: str = ""
    """One line shown by ``nexrl plugins``."""
    capabilities: frozenset[str] = attrs.field(factory=frozenset, converter=string_frozenset)
    """Free-form flags the conformance kit and the loop can check (e.g. ``group_relative``)."""

    def resolve_factory(self) -> Callable[..., Any]:
        """Import the factory if it is a string reference and return the callable."""
        return self._resolve("factory", self.factory)

    def _resolve(self, field: str, reference: Factory) -> Callable[..., Any]:
        """``reference`` itself when callable, else the ``package.module:attribute`` it names, imported."""
        if callable(reference):
            return reference
        module_name, _, attr_path = reference.partition(":")
        if not attr_path:
            raise ValueError(f"{self.kind} {self.name!r}: {field} {reference!r} must look like 'package.module:attribute'")
        target: Any = importlib.import_module(module_name)
        for part in attr_path.split("."):
            target = getattr(target, part)
        if not callable(target):
            raise TypeError(f"{self.kind} {self.name!r}: {field} {reference!r} is a {type(target).__name__}, not a callable")
        resolved: Callable[..., Any] = target
        return resolved

    def build(self, config: Any = None) -> Any:
        """Build the implementation with ``config`` (default: the config class's defaults)."""
        if config is None:
            config = self.config_class()
        else:
            self._check_config(config)
        return self.resolve_factory()(config)

    def _check_config(self, config: Any) -> None:
        if not isinstance(config, self.config_class):
            raise TypeError(f"{self.kind} {self.name!r} takes a {self.config_class.__name__} config, got {type(config).__name__}")


@attrs.frozen(kw_only=True)
class _SetupSpec(ComponentSpec):
    """A component built for one run: its factory takes a setup record (the recipe, its
    own options as ``config_class``, a work directory) instead of the bare options."""

    def open(self, setup: Any) -> Any:
        """Build the implementation for one run from ``setup`` (whose ``options`` must be
        a ``config_class`` instance)."""
        self._check_config(setup.options)
        return self.resolve_factory()(setup)


@attrs.frozen(kw_only=True)
class _CheckedSetupSpec(_SetupSpec):
    """A run's backend or rollout source, which may check the recipe before anything opens."""

    recipe_check: Factory | None = None
    """Called as ``recipe_check(recipe, options)`` (its options as ``config_class``) before
    any component of a run opens; returns the problems it sees in the recipe without
    starting anything, as ``key: what to do`` lines. A run it finds fault with is refused
    in a second, not after the backend has started its services. A callable or a
    ``package.module:function`` reference; None: nothing to check before opening."""

    def recipe_problems(self, recipe: Any, options: Any) -> list[str]:
        """`recipe_check`'s problems with ``recipe`` (none without a check)."""
        if self.recipe_check is None:
            return []
        return list(self._resolve("recipe_check", self.recipe_check)(recipe, options))


@attrs.frozen(kw_only=True)
class AdvantageEstimatorSpec(ComponentSpec):
    """Registers an advantage estimator (see `nexrl_core.training.algorithms.AdvantageEstimator`)."""

    kind: ClassVar[str] = "advantage_estimator"


@attrs.frozen(kw_only=True)
class PolicyLossSpec(ComponentSpec):
    """Registers a policy loss (see `nexrl_core.training.algorithms.PolicyLoss`)."""

    kind: ClassVar[str] = "policy_loss"


@attrs.frozen(kw_only=True)
class TrainerSpec(ComponentSpec):
    """Registers a trainer: turns trajectories into updates on a backend."""

    kind: ClassVar[str] = "trainer"


@attrs.frozen(kw_only=True)
class ServiceHolderSpec(ComponentSpec):
    """Registers a service holder: one client for sampling and training on a backend."""

    kind: ClassVar[str] = "service_holder"


@attrs.frozen(kw_only=True)
class TransportSpec(ComponentSpec):
    """Registers a transport that carries batches from a trainer to its workers."""

    kind: ClassVar[str] = "transport"


@attrs.frozen(kw_only=True)
class ServiceSpec(ComponentSpec):
    """Registers a server NexRL can run itself (``nexrl serve NAME``), such as the local
    Tinker-compatible service; the factory takes `nexrl_core.http.serving.ServeOptions`."""

    kind: ClassVar[str] = "service"


@attrs.frozen(kw_only=True)
class PlacerSpec(ComponentSpec):
    """Registers a placer: what starts the ranks of worker groups (see
    `nexrl_core.training.placement.Placer`); the factory takes ``config_class`` options."""

    kind: ClassVar[str] = "placer"


@attrs.frozen(kw_only=True)
class RankCommand:
    """How a person starts one rank of a plugin's worker groups by hand: ``torchrun ... -m
    MODULE FLAGS``. The plugin that runs the ranks states it, so the core can write such
    lines (``nexrl convert-v1 --launch``) without naming the plugin's module, and refuses
    exactly the values the rank itself would refuse, with the rank's own reasons."""

    module: str = attrs.field(validator=attrs.validators.matches_re(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$"))
    """The ``python -m`` module of one rank."""
    choices: Mapping[str, tuple[str, ...]] = attrs.field(factory=dict)
    """Flags the rank takes with these values only, e.g. ``{"--dispatch-mode": ("scatter",)}``."""
    refused: Mapping[str, Mapping[str, str]] = attrs.field(factory=dict)
    """For a flag of ``choices``, values the rank refuses by name, each with why."""


@attrs.frozen(kw_only=True)
class GroupEngineSpec(ComponentSpec):
    """Registers what trains a local service's models on worker groups of ranks (see
    `nexrl_core.training.worker_groups.GroupEngines`); the factory takes ``config_class`` options."""

    kind: ClassVar[str] = "group_engine"

    rank_command: RankCommand | None = None
    """How the groups' ranks are started by hand, when they can be (see `RankCommand`)."""


@attrs.frozen(kw_only=True)
class TaskSpec(ComponentSpec):
    """Registers a task (items plus agent, see `nexrl_core.run.tasks.Task`) by name."""

    kind: ClassVar[str] = "task"


@attrs.frozen(kw_only=True)
class BackendSpec(_CheckedSetupSpec):
    """Registers a backend (see `nexrl_core.training.backend.Backend`); the factory takes a
    `nexrl_core.training.backend.BackendSetup`."""

    kind: ClassVar[str] = "backend"


@attrs.frozen(kw_only=True)
class RolloutSourceSpec(_CheckedSetupSpec):
    """Registers a rollout source (see `nexrl_core.training.backend.RolloutSource`); the factory
    takes a `nexrl_core.training.backend.RolloutSetup`."""

    kind: ClassVar[str] = "rollout_source"


@attrs.frozen(kw_only=True)
class MetricsSinkSpec(_SetupSpec):
    """Registers a metrics sink (see `nexrl_core.run.sinks.MetricsSink`): a tracker a run's
    metric rows go to besides ``metrics.jsonl``; the factory takes a
    `nexrl_core.run.sinks.SinkSetup`."""

    kind: ClassVar[str] = "metrics_sink"

    default: bool = False
    """Whether a recipe that leaves ``output.sinks`` unset uses this sink. The core names
    no sink, so an installed plugin saying so is what makes a sink the default."""
