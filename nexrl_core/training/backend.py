"""The two seams of ``nexrl train``: where the model runs (a backend) and where rollouts come from.

The loop knows nothing else about where work happens. A plugin registers a backend
(``nexrl_backends``) and a recipe picks it with ``backend.name``; a plugin registers a
rollout source (``nexrl_rollout_sources``) and a recipe picks it with
``rollout.source.name``. Each spec's factory receives a setup record: the whole recipe
(already checked), the component's own options structured into its config class, and
a directory the component may keep files in.

A backend owns the model: it gives rollouts a `ChatModel` to sample from, trains on a
step's trajectories, publishes the new weights to sampling, saves and restores what
``--resume`` needs, writes the policy out as a plain Hugging Face directory (the run's
``final_model``, and ``nexrl export``), and releases everything on `Backend.close`. A
checkpoint may be saved in the background while the next step runs. A rollout source turns
a step's run requests into trajectories with rewards, sampling through that
`ChatModel`.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from nexrl_core.chat.model import ChatModel
from nexrl_core.types import Trajectory

CONTEXT_KEY = "max_context_length"
"""`Backend.run_info` key of the model's context in tokens, where the backend knows it; the
loop refuses a ``rollout.max_tokens`` (with ``rollout.max_prompt_tokens``) that does not fit."""

TEACHER_BACKEND = "teacher"
"""Capability of a `nexrl_core.plugins.specs.BackendSpec` whose backend holds the recipe's
``teacher`` model beside the student and gives the trainer its log-probs; the loop
refuses ``teacher.model`` on any other backend before opening it."""

if TYPE_CHECKING:
    from nexrl_core.config.schema import TrainConfig
    from nexrl_core.run.rollout import Agent, PendingBatch, RunRequest


class BackendLost(RuntimeError):
    """Part of the backend died or stopped making progress (a worker rank, a node) and
    took the step in flight with it. A backend that can heal raises this and has a
    `RestartableBackend.restart`; the loop then restarts it from the last complete
    checkpoint and runs the lost steps again."""


class BackendStartError(RuntimeError):
    """A part of the backend could not start (a worker rank that fails to initialise, a
    model that does not load): the message is one line naming the part, the cause and
    where its log is, and nothing the backend started is left running. Retrying does not
    help, so a run stops before step 1."""


class Backend(Protocol):
    """Where the policy is sampled and trained; built by a registered `BackendSpec`."""

    def chat_model(self) -> ChatModel:
        """What rollouts sample from; always sees the weights of the last `sync_weights`."""
        ...

    def train(self, trajectories: Sequence[Trajectory], step: int) -> dict[str, float]:
        """One update from a step's trajectories (``step`` is 1-based); returns float metrics."""
        ...

    def sync_weights(self, step: int) -> str | None:
        """Make sampling use the weights of the last `train`; returns where they are, or
        None when that call changed nothing. Called once no rollout that must see the
        previous weights is still running."""
        ...

    def save_checkpoint(self, name: str) -> str | concurrent.futures.Future[str]:
        """Save weights, optimizer and any trainer state resume needs; returns a path
        that `load_checkpoint` takes, or a `concurrent.futures.Future` of that path when
        the backend writes in the background. A future must resolve only once the
        checkpoint is complete (or fail with why it is not); until then the backend keeps
        serving the next step (calls that need what the save uses may wait for it). The
        loop records a checkpoint for ``--resume`` only once its future has a result, in
        step order, and waits for every save before the final export and at the end
        (`nexrl_core.run.checkpoints`)."""
        ...

    def load_checkpoint(self, path: str) -> None:
        """Continue from a checkpoint of `save_checkpoint`, sampling included."""
        ...

    def export_model(self, directory: Path) -> Path:
        """Write the weights sampling uses (those of the last `sync_weights` or
        `load_checkpoint`) into ``directory`` as a plain Hugging Face model directory:
        weights, ``config.json``, tokenizer and chat template, so that
        ``transformers.AutoModelForCausalLM.from_pretrained(directory)`` loads it. LoRA
        adapters are merged into the base weights, and the adapter is also kept in PEFT
        layout in ``directory / "adapter"``. Returns ``directory``.

        :raises nexrl_core.training.model_export.ModelExportError: naming the backend, when it
            cannot export (the loop reports it; the run's checkpoints stay intact).
        """
        ...

    def run_info(self) -> Mapping[str, str]:
        """How the backend actually runs the model, as far as it knows (``dtype`` of the
        trained weights, say): what a recipe asks for is only a request, and the first
        row of a fresh run's ``metrics.jsonl`` records these under ``backend/<key>``.
        Empty when a remote service does not say."""
        ...

    def close(self) -> None:
        """Release everything the backend started: clients, services, processes, threads."""
        ...


class WatchedBackend(Backend, Protocol):
    """A backend that can tell when a part it started died (a sampler process, an embedded
    service). Such a death reaches the loop as whatever error the next call meets (a refused
    connection in an agent's sampling call, say); the loop asks `lost` about any error a
    step ends with and treats the step as a `BackendLost` when it names a reason."""

    def lost(self) -> str | None:
        """Why a part this backend started is gone, naming it and the end of its log;
        None while every part is up."""
        ...


def backend_lost_reason(backend: Backend) -> str | None:
    """`WatchedBackend.lost` of a backend that watches its parts; None for one that does not."""
    watch = getattr(backend, "lost", None)
    return watch() if watch is not None else None


class RestartableBackend(Backend, Protocol):
    """A backend that heals after raising `BackendLost` (the loop looks for `restart`)."""

    def restart(self) -> bool:
        """Stop what is left of the lost part and start it afresh at the base weights,
        sampling included; False when the restarts the recipe allows are spent (nothing
        is started then). After a restart the loop loads the last complete checkpoint
        through `load_checkpoint`, if there is one, and runs the steps after it again."""
        ...


@attrs.frozen(kw_only=True)
class BackendSetup:
    """What a backend factory is called with."""

    recipe: TrainConfig
    """The whole recipe, checked."""
    options: Any
    """``backend.options`` structured into the spec's config class."""
    work_dir: Path
    """``<output.dir>/backend``: files the backend keeps across ``--resume`` (an embedded
    service's database and checkpoints, say). Created by the loop."""


class RolloutSource(Protocol):
    """Turns run requests into finished runs (trajectories with rewards)."""

    def submit(self, step: int, requests: Sequence[RunRequest], temperature: float | None = None) -> PendingBatch:
        """Start every request; ``temperature`` replaces the recipe's (validation passes its own)."""
        ...

    def close(self) -> None:
        """Stop: runs still going fail at their next model call; nothing is left running."""
        ...


@attrs.frozen(kw_only=True)
class RolloutSetup:
    """What a rollout source factory is called with."""

    recipe: TrainConfig
    """The whole recipe, checked."""
    options: Any
    """``rollout.source.options`` structured into the spec's config class."""
    model: ChatModel
    """The backend's chat model every run samples from."""
    agent: Agent | None
    """The task's agent function (None when the task has none: runs are driven from elsewhere)."""
    work_dir: Path
    """``<output.dir>/rollout``: files the source keeps across ``--resume``."""
    backend_lost: Callable[[], str | None] = lambda: None
    """Why a part of the backend died, if one did (`backend_lost_reason`): an agent run
    that fails meanwhile failed because of it, not of the agent, and is logged without
    its traceback."""
