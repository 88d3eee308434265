"""Entry-point module of nexrl-episodes: the ``episodes`` rollout source and its options.

Imports nothing heavy: the server, the store and FastAPI load only when a recipe picks
``rollout.source.name: episodes``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from nexrl_core.plugins.hookspecs import hookimpl
from nexrl_core.plugins.specs import RolloutSourceSpec

if TYPE_CHECKING:
    from nexrl_core.training.backend import RolloutSetup
    from nexrl_episodes.source import EpisodeSource


def _port(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if not 0 <= value <= 65535:
        raise ValueError(f"{attribute.name} must be a TCP port between 0 and 65535 (0: any free port), got {value}")


@attrs.frozen(kw_only=True)
class LocalWorkers:
    """Client processes ``nexrl train`` starts next to the server, for one machine."""

    processes: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    """How many worker processes to start (0: none; scripts elsewhere claim the episodes)."""
    script: str | None = None
    """What each worker runs per episode: a ``.py`` file (relative to the current
    directory) or ``package.module:function``; the function takes an `Episode`."""
    concurrency: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    """Episodes each worker process keeps in flight (one thread each)."""


@attrs.frozen(kw_only=True)
class EpisodesOptions:
    """``rollout.source.options`` of the ``episodes`` source."""

    host: str = "127.0.0.1"
    """Interface the episode server binds; open it to other machines deliberately."""
    port: int = attrs.field(default=0, validator=_port)
    """TCP port; 0 picks a free one (written to ``<output.dir>/rollout/episode_server.json``)."""
    public_url: str | None = None
    """The base URL clients reach the server at, when it differs from ``http://host:port``
    (a proxy, NAT); used in the ``base_url`` handed out with each claim."""
    db_url: str | None = None
    """SQLAlchemy URL of the episode store; null keeps a SQLite file in the run's
    ``rollout/`` directory, so ``--resume`` finds the episodes that already ended."""
    api_key: str | None = None
    """When set, claiming needs ``Authorization: Bearer <api_key>``; null accepts any
    caller that can reach the server (fine on 127.0.0.1)."""
    claim_timeout_s: float = attrs.field(default=60.0, validator=attrs.validators.gt(0))
    """A claimed episode with no activity (claim, model call, can_continue) for this
    long goes back to the queue; the stale claimer's key stops working."""
    max_attempts: int = attrs.field(default=5, validator=attrs.validators.ge(1))
    """Claims one episode may get (aborts and stale claims included) before its run
    counts as failed, so a step never waits forever on an episode that kills clients."""
    local_workers: LocalWorkers = attrs.field(factory=LocalWorkers)
    """Worker processes started with the run (the quickstart uses them)."""

    def __attrs_post_init__(self) -> None:
        if self.local_workers.processes and not self.local_workers.script:
            raise ValueError(
                "local_workers.script must name what the worker processes run (a .py file or module:function) "
                f"when local_workers.processes={self.local_workers.processes}"
            )


def recipe_problems(recipe: Any, options: EpisodesOptions) -> list[str]:
    """What the episodes source refuses in a recipe, seen before anything starts: a
    ``rollout.concurrency`` it would ignore (clients decide how many episodes run at
    once), and local workers whose script file does not exist."""
    problems = []
    if recipe.rollout.concurrency is not None:
        problems.append(
            f"rollout.concurrency: {recipe.rollout.concurrency} has no effect with rollout.source.name=episodes, where "
            "clients decide how many episodes run at once; remove it (null), and set "
            "rollout.source.options.local_workers.{processes,concurrency} or each worker's --concurrency"
        )
    script = options.local_workers.script
    if options.local_workers.processes and script and script.endswith(".py") and not Path(script).is_file():
        problems.append(
            f"rollout.source.options.local_workers.script: {script!r} does not exist (paths are relative to the current directory)"
        )
    return problems


def open_episode_source(setup: RolloutSetup) -> EpisodeSource:
    """Start the episode server for one run (see `nexrl_episodes.source.EpisodeSource`)."""
    from nexrl_episodes.source import EpisodeSource

    return EpisodeSource.open(setup)


@hookimpl
def nexrl_rollout_sources() -> list[RolloutSourceSpec]:
    """The episode server: scripts anywhere claim runs over HTTP."""
    return [
        RolloutSourceSpec(
            name="episodes",
            factory=open_episode_source,
            config_class=EpisodesOptions,
            recipe_check=recipe_problems,
            description="Episode server: scripts on any machine claim runs over HTTP and sample through an OpenAI endpoint",
        )
    ]
