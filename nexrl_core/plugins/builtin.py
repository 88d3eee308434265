"""The core's own components, registered through its own entry point like any plugin's.

Only the default rollout source lives here: agent functions on a thread pool
(`nexrl_core.run.rollout.RolloutRunner`). Everything that needs a model, a service or a
network protocol is a plugin.
"""

from __future__ import annotations

from nexrl_core.config.errors import ConfigError
from nexrl_core.plugins.hookspecs import hookimpl
from nexrl_core.plugins.specs import RolloutSourceSpec
from nexrl_core.training.backend import RolloutSetup


def open_thread_runner(setup: RolloutSetup) -> object:
    """The ``threads`` rollout source: ``rollout.concurrency`` agent runs at once in this process."""
    from nexrl_core.run.limits import TurnLimits
    from nexrl_core.run.llm_client import SamplingDefaults
    from nexrl_core.run.rollout import RolloutRunner

    rollout = setup.recipe.rollout
    if setup.agent is None:
        raise ConfigError(["rollout.source.name: 'threads' runs the task's agent function, and this task has none"])
    return RolloutRunner(
        setup.model,
        setup.agent,
        concurrency=rollout.runs_in_flight(),
        defaults=SamplingDefaults(max_tokens=rollout.max_tokens, temperature=rollout.temperature, top_p=rollout.top_p),
        model=setup.recipe.model.name or "nexrl-policy",
        backend_lost=setup.backend_lost,
        limits=TurnLimits.of(rollout),
    )


@hookimpl
def nexrl_rollout_sources() -> list[RolloutSourceSpec]:
    """The thread-pool runner of agent functions."""
    return [
        RolloutSourceSpec(
            name="threads",
            factory=open_thread_runner,
            description="Runs the task's agent function on a thread pool in the training process",
        )
    ]
