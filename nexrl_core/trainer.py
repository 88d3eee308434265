"""Trainers turn a step's trajectories into one update on the backend.

`RemoteApiTrainer` serves remote training APIs (Tinker, Weaver, NexRL's local services),
where the backend owns the model and the optimizer: it computes advantages locally with
the configured estimator, converts each trajectory into a `RemoteDatum` (input
``tokens[:-1]``, target ``tokens[1:]``, the sampler's logprobs as the behaviour policy,
per-token advantages times the loss mask), leaves out datums whose advantages are all
zero (a group whose runs all scored the same teaches nothing), and sends the rest with
one `TrainStepConfig` carrying every AdamW parameter, weight decay and gradient clipping
included. `sync_weights` then points sampling at the new weights.

The GRPO flavour (``remote_api_grpo``) is registered by the ``nexrl-grpo`` plugin.
This module imports torch only inside `RemoteApiTrainer.compute_advantages`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import attrs

from nexrl_core.config.errors import ConfigError
from nexrl_core.config.schema import ComponentChoice, TrainConfig
from nexrl_core.holders import ServiceHolder, TrainStepConfig
from nexrl_core.types import RemoteDatum, Trajectory


class Trainer(Protocol):
    """What ``nexrl train`` asks of the trainer a recipe names in ``backend.trainer``.

    A trainer spec's config class may define ``from_recipe(config: TrainConfig)``; the
    loop then builds the trainer's config from the recipe, otherwise with its defaults.
    """

    def train(self, holder: ServiceHolder, trajectories: Sequence[Trajectory], step: int) -> dict[str, float]:
        """One update from ``trajectories`` (training step ``step``, 1-based); returns metrics."""
        ...

    def sync_weights(self, holder: ServiceHolder, step: int) -> str | None:
        """Make sampling use the weights of the last `train` call; returns their path, or
        None when that call changed nothing. The loop calls it once no rollout that must
        see the previous weights is still running."""
        ...


def _numeric_options(options: Any) -> dict[str, float]:
    """The numeric fields of an attrs options object, as floats (None, enums and bools dropped)."""
    if options is None or not attrs.has(type(options)):
        return {}
    values = {}
    for field in attrs.fields(type(options)):
        value = getattr(options, field.name)
        if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
            values[field.name] = float(value)
    return values


@attrs.frozen(kw_only=True)
class RemoteApiTrainerConfig:
    """Everything a remote-API trainer needs, built from the recipe's ``algorithm`` section."""

    advantage: ComponentChoice = attrs.field(factory=lambda: ComponentChoice(name="grpo"))
    """Registered advantage estimator."""
    advantage_options: Any = None
    """The estimator's options as its config class (None: its defaults)."""
    train_step: TrainStepConfig = attrs.field(factory=TrainStepConfig)
    """Loss and optimizer settings sent with every step."""

    @classmethod
    def from_recipe(cls, config: TrainConfig) -> RemoteApiTrainerConfig:
        """Read ``algorithm``: estimator, loss (its numeric options become ``loss_fn_config``)
        and every AdamW parameter.

        :raises ConfigError: for bad component options, or a KL penalty, which a remote
            API cannot apply (it returns no reference-model logprobs).
        """
        from nexrl_core.config.components import resolve_options

        algorithm = config.algorithm
        problems = []
        if algorithm.kl.coef != 0:
            problems.append(
                "algorithm.kl.coef: remote-API trainers cannot apply a KL penalty (the service returns no "
                f"reference-model logprobs); set it to 0, got {algorithm.kl.coef!r}"
            )
        advantage_options = loss_options = None
        try:
            advantage_options = resolve_options("advantage_estimators", algorithm.advantage, "algorithm.advantage")
        except ConfigError as error:
            problems += error.problems
        try:
            loss_options = resolve_options("policy_losses", algorithm.loss, "algorithm.loss")
        except ConfigError as error:
            problems += error.problems
        if problems:
            raise ConfigError(problems)
        return cls(
            advantage=algorithm.advantage,
            advantage_options=advantage_options,
            train_step=TrainStepConfig(
                loss_fn=algorithm.loss.name,
                loss_fn_config=_numeric_options(loss_options),
                learning_rate=algorithm.learning_rate,
                beta1=algorithm.beta1,
                beta2=algorithm.beta2,
                eps=algorithm.eps,
                weight_decay=algorithm.weight_decay,
                grad_clip_norm=algorithm.grad_clip_norm,
            ),
        )


def _run_key(run_id: Any) -> tuple[int, Any]:
    return (0, run_id) if isinstance(run_id, int) else (1, str(run_id))


def sort_trajectories(trajectories: Sequence[Trajectory]) -> list[Trajectory]:
    """A fixed order whatever order rollouts finished in: by group, run, then position in the run."""
    return sorted(
        trajectories,
        key=lambda t: (t.group_id, _run_key(t.run_id), t.extra.get("trajectory_index", 0), t.task_id),
    )


class RemoteApiTrainer:
    """Advantages locally, forward-backward and the optimizer step on the remote service."""

    def __init__(self, config: RemoteApiTrainerConfig | None = None) -> None:
        self.config = config or RemoteApiTrainerConfig()
        self._estimator: Any = None
        self._changed = False

    @property
    def estimator(self) -> Any:
        if self._estimator is None:
            from nexrl_core.registry import get_advantage_estimator

            self._estimator = get_advantage_estimator(self.config.advantage.name, self.config.advantage_options)
        return self._estimator

    def compute_advantages(self, trajectories: Sequence[Trajectory]) -> tuple[list[list[float]], dict[str, float]]:
        """Per-token advantages aligned with each trajectory's tokens, and the estimator's metrics."""
        from nexrl_core.batch import Batch

        batch = Batch.from_trajectories(trajectories, pad_token_id=0)
        output = self.estimator(batch.to_advantage_inputs())
        table = output.advantages.detach().to("cpu").double()
        prompt_length = batch.prompt_length
        advantages = []
        for row, trajectory in enumerate(trajectories):
            start = next((i for i, flag in enumerate(trajectory.loss_mask) if flag == 1), len(trajectory.tokens))
            offset = prompt_length - start
            values = table[row, offset : offset + len(trajectory.tokens)].tolist()
            advantages.append([value * flag for value, flag in zip(values, trajectory.loss_mask)])
        return advantages, {key: float(value) for key, value in output.metrics.items()}

    def to_datums(
        self, trajectories: Sequence[Trajectory], advantages: Sequence[Sequence[float]]
    ) -> tuple[list[RemoteDatum], int]:
        """The datums worth sending, and how many were skipped (all-zero advantages, or too short)."""
        datums, skipped = [], 0
        for trajectory, values in zip(trajectories, advantages):
            if len(trajectory.tokens) < 2:
                skipped += 1
                continue
            datum = RemoteDatum.from_trajectory(trajectory, values)
            if datum.all_advantages_zero:
                skipped += 1
                continue
            datums.append(datum)
        return datums, skipped

    def extra_metrics(
        self, trajectories: Sequence[Trajectory], advantages: Sequence[Sequence[float]]
    ) -> dict[str, float]:
        """Flavour-specific metrics; subclasses add to them."""
        return {}

    def train(self, holder: ServiceHolder, trajectories: Sequence[Trajectory], step: int) -> dict[str, float]:
        ordered = sort_trajectories(trajectories)
        metrics: dict[str, float] = {}
        self._changed = False
        if not ordered:
            return {"datums/trained": 0.0, "datums/skipped": 0.0}
        advantages, estimator_metrics = self.compute_advantages(ordered)
        metrics.update(estimator_metrics)
        metrics.update(self.extra_metrics(ordered, advantages))
        datums, skipped = self.to_datums(ordered, advantages)
        metrics["datums/trained"] = float(len(datums))
        metrics["datums/skipped"] = float(skipped)
        metrics["datums/trained_tokens"] = float(sum(sum(datum.loss_mask) for datum in datums))
        if datums:
            result = holder.train(datums, self.config.train_step)
            metrics.update(_readable(_prefixed("train/", result)))
            self._changed = True
        return metrics

    def sync_weights(self, holder: ServiceHolder, step: int) -> str | None:
        if not self._changed:
            return None
        self._changed = False
        return holder.update_sampling_weights()


def _prefixed(prefix: str, values: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in (values or {}).items():
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            out[key if key.startswith(prefix) else f"{prefix}{key}"] = float(value)
    return out


def _readable(metrics: dict[str, float]) -> dict[str, float]:
    """Add plain names for metrics a Tinker-style backend reports as ``name:reduction``:
    ``x:mean`` is also ``x``, and ``loss:sum`` over ``num_tokens:sum`` is ``loss`` (per token)."""
    out = dict(metrics)
    for key, value in metrics.items():
        if key.endswith(":mean") and key[: -len(":mean")] not in out:
            out[key[: -len(":mean")]] = value
    tokens = metrics.get("train/num_tokens:sum")
    if "train/loss" not in out and "train/loss:sum" in metrics and tokens:
        out["train/loss"] = metrics["train/loss:sum"] / tokens
    return out
