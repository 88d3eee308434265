"""Hook specifications: what a NexRL plugin can provide.

Every hook takes no arguments and returns a list of spec records (see `nexrl_core.plugins.specs`).
A plugin implements only the hooks it needs. Full documentation, with examples, is in
``docs/plugins.md``.
"""

from __future__ import annotations

import pluggy

from nexrl_core.plugins.specs import (
    AdvantageEstimatorSpec,
    BackendSpec,
    GroupEngineSpec,
    MetricsSinkSpec,
    PlacerSpec,
    PolicyLossSpec,
    RolloutSourceSpec,
    ServiceHolderSpec,
    ServiceSpec,
    TaskSpec,
    TrainerSpec,
    TransportSpec,
)

PROJECT = "nexrl"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# --- algorithms -------------------------------------------------------------------------


@hookspec
def nexrl_advantage_estimators() -> list[AdvantageEstimatorSpec]:
    """Register advantage estimators.

    Called once, when the registries are first built.

    :return: the plugin's `AdvantageEstimatorSpec` records, looked up by name through
        ``get_advantage_estimator(name)`` and ``algorithm.advantage.name`` in a recipe.
    """


@hookspec
def nexrl_policy_losses() -> list[PolicyLossSpec]:
    """Register policy losses.

    Called once, when the registries are first built. Every place that computes a loss
    (self-hosted workers, the local Tinker and Weaver services) looks it up here by name,
    so there is one source of loss math.

    :return: the plugin's `PolicyLossSpec` records, looked up through
        ``get_policy_loss(name)`` and ``algorithm.loss.name``.
    """


# --- tasks ------------------------------------------------------------------------------


@hookspec
def nexrl_tasks() -> list[TaskSpec]:
    """Register tasks: training and validation items plus the agent that runs them.

    Called once, when the registries are first built.

    :return: the plugin's `TaskSpec` records, looked up by ``task.name`` in a recipe.
    """


# --- training -----------------------------------------------------------------------------


@hookspec
def nexrl_trainers() -> list[TrainerSpec]:
    """Register trainers.

    Called once, when the registries are first built.

    :return: the plugin's `TrainerSpec` records, looked up through ``get_trainer(name)``
        and by the backend that trains with them (``backend.options.trainer``).
    """


# --- backends -----------------------------------------------------------------------------


@hookspec
def nexrl_backends() -> list[BackendSpec]:
    """Register backends: where ``nexrl train`` samples and trains the policy.

    Called once, when the registries are first built. The factory is called with a
    `nexrl_core.training.backend.BackendSetup` and returns a `nexrl_core.training.backend.Backend`.

    :return: the plugin's `BackendSpec` records, looked up by ``backend.name`` in a
        recipe; ``backend.options`` is structured into the spec's config class.
    """


@hookspec
def nexrl_rollout_sources() -> list[RolloutSourceSpec]:
    """Register rollout sources: what turns a step's run requests into rewarded trajectories.

    Called once, when the registries are first built. The factory is called with a
    `nexrl_core.training.backend.RolloutSetup` and returns a `nexrl_core.training.backend.RolloutSource`.

    :return: the plugin's `RolloutSourceSpec` records, looked up by
        ``rollout.source.name`` in a recipe.
    """


@hookspec
def nexrl_service_holders() -> list[ServiceHolderSpec]:
    """Register service holders: clients that sample from and train a model on a backend.

    Called once, when the registries are first built.

    :return: the plugin's `ServiceHolderSpec` records, looked up through
        ``get_service_holder(name)`` and by backends that drive a service holder
        (``backend.options.service_holder``).
    """


@hookspec
def nexrl_transports() -> list[TransportSpec]:
    """Register transports that carry batches from a trainer to its training workers.

    Called once, when the registries are first built.

    :return: the plugin's `TransportSpec` records, looked up through
        ``get_transport(name)`` and by backends that drive workers through one.
    """


@hookspec
def nexrl_services() -> list[ServiceSpec]:
    """Register servers that NexRL runs itself, such as a local Tinker-compatible service.

    Called once, when the registries are first built.

    :return: the plugin's `ServiceSpec` records, started by ``nexrl serve NAME`` and by
        backends that start a local service for a run (an embedded service).
    """


@hookspec
def nexrl_placers() -> list[PlacerSpec]:
    """Register placers: what starts the ranks of worker groups on a cluster.

    Called once, when the registries are first built. The factory is called with the
    spec's config class and returns a `nexrl_core.training.placement.Placer`.

    :return: the plugin's `PlacerSpec` records, looked up through ``get_placer(name)``
        and named by ``--placement`` of a service and ``backend.options.placement``.
    """


@hookspec
def nexrl_group_engines() -> list[GroupEngineSpec]:
    """Register what trains a local service's models on worker groups (``--workers N``).

    Called once, when the registries are first built. The factory is called with the
    spec's config class and returns a `nexrl_core.training.worker_groups.GroupEngines`; a service
    uses the one active plugin's and refuses to start with workers when there is none.

    :return: the plugin's `GroupEngineSpec` records (one is all a service can use),
        opened through ``nexrl_core.training.worker_groups.open_group_engines()``.
    """


# --- reporting --------------------------------------------------------------------------------


@hookspec
def nexrl_metrics_sinks() -> list[MetricsSinkSpec]:
    """Register metrics sinks: trackers a run reports to besides ``metrics.jsonl``.

    Called once, when the registries are first built. The factory is called with a
    `nexrl_core.run.sinks.SinkSetup` and returns a `nexrl_core.run.sinks.MetricsSink`.

    :return: the plugin's `MetricsSinkSpec` records, picked by name in a recipe's
        ``output.sinks`` (each with its ``options``, structured into the spec's config
        class); a recipe that leaves ``output.sinks`` unset uses those whose spec says
        ``default=True``.
    """
