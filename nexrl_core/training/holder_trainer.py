"""`HolderTrainer`: advantages here, forward-backward and the optimizer step on a service holder.

It serves every backend whose model sits behind a service holder (a hosted or local
service through the remote-API backend, the in-process engine): it computes advantages locally with
the configured estimator, converts each trajectory into a `RemoteDatum` (input
``tokens[:-1]``, target ``tokens[1:]``, the sampler's logprobs as the behaviour policy,
per-token advantages times the loss mask), leaves out datums whose advantages are all
zero (a group whose runs all scored the same teaches nothing), and sends the rest with
one `TrainStepConfig` carrying every option of the loss and every AdamW parameter.
`sync_weights` then points sampling at the new weights.

Flavours subclass it: `shape_rewards` is where per-token reward terms (a KL penalty
against the reference model, in the GRPO flavour) enter before advantages are
computed. An estimator that lists ``teacher_logprobs`` in its ``requires`` (on-policy
distillation) gets the recipe's teacher's log-probs of every trajectory from the holder
(`nexrl_core.training.holders.TeacherHolder`), laid out as the reference's are for a KL penalty.
`HolderTrainerConfig.from_recipe` is where the recipe's ``algorithm``
section (estimator, loss options, KL, every AdamW parameter) becomes the
`TrainStepConfig` every holder-driving trainer sends; self-hosted trainers reuse it. This
module imports torch only where advantages are computed.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import attrs

from nexrl_core.config.adamw import AdamWSettings
from nexrl_core.config.errors import ConfigError
from nexrl_core.config.lr_schedule import LearningRateSchedule
from nexrl_core.config.schema import ComponentChoice, KLSettings, TeacherConfig, TrainConfig
from nexrl_core.run.metrics import readable_train_metrics
from nexrl_core.training.algorithms import TEACHER_LOGPROBS
from nexrl_core.training.holders import LossOptionValue, ServiceHolder, TeacherHolder, TrainStepConfig
from nexrl_core.types import RemoteDatum, Trajectory, sort_trajectories

if TYPE_CHECKING:
    import torch

    from nexrl_core.training.batch import Batch


def loss_option_values(options: Any) -> dict[str, LossOptionValue]:
    """Every option of an attrs loss config as it travels: enum members by value, None left out."""
    if options is None or not attrs.has(type(options)):
        return {}
    values: dict[str, LossOptionValue] = {}
    for field in attrs.fields(type(options)):
        value = getattr(options, field.name)
        if value is None:
            continue
        values[field.name] = value.value if isinstance(value, enum.Enum) else value
    return values


def step_with_scheduled_rate(train_step: TrainStepConfig, schedule: LearningRateSchedule | None, step: int) -> TrainStepConfig:
    """``train_step`` with the learning rate ``schedule`` gives ``step`` (1-based) in its
    AdamW settings: what a trainer sends for that step."""
    if schedule is None or schedule.is_constant:
        return train_step
    optimizer = train_step.optimizer
    rate = schedule.rate(optimizer.learning_rate, step)
    return attrs.evolve(train_step, optimizer=attrs.evolve(optimizer, learning_rate=rate))


@attrs.frozen(kw_only=True)
class HolderTrainerConfig:
    """Everything a holder trainer needs, built from the recipe's ``algorithm`` section."""

    advantage: ComponentChoice = attrs.field(factory=lambda: ComponentChoice(name="grpo"))
    """Registered advantage estimator."""
    advantage_options: Any = None
    """The estimator's options as its config class (None: its defaults)."""
    train_step: TrainStepConfig = attrs.field(factory=TrainStepConfig)
    """Loss (with every option) and optimizer settings sent with every step."""
    kl: KLSettings = attrs.field(factory=KLSettings)
    """KL penalty against the reference model (``coef`` 0: none)."""
    lr_schedule: LearningRateSchedule = attrs.field(factory=LearningRateSchedule)
    """How each step's learning rate follows from ``train_step.optimizer.learning_rate``
    (``algorithm.lr_schedule``, ``algorithm.warmup_steps``, ``schedule.steps``)."""
    teacher: TeacherConfig = attrs.field(factory=TeacherConfig)
    """The recipe's ``teacher``: set exactly when the estimator reads teacher log-probs."""

    @classmethod
    def from_recipe(cls, config: TrainConfig) -> HolderTrainerConfig:
        """Read ``algorithm``: estimator, loss with all its options, KL and every AdamW parameter.

        :raises ConfigError: for bad component options.
        """
        from nexrl_core.config.components import resolve_options

        algorithm = config.algorithm
        problems = []
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
        assert algorithm.loss.name is not None
        optimizer = AdamWSettings(**{field.name: getattr(algorithm, field.name) for field in attrs.fields(AdamWSettings)})
        return cls(
            advantage=algorithm.advantage,
            advantage_options=advantage_options,
            train_step=TrainStepConfig(
                loss_fn=algorithm.loss.name,
                loss_fn_config=loss_option_values(loss_options),
                optimizer=optimizer,
            ),
            kl=algorithm.kl,
            lr_schedule=LearningRateSchedule.from_recipe(config),
            teacher=config.teacher,
        )


def build_estimator(config: HolderTrainerConfig) -> Any:
    """The advantage estimator ``config.advantage`` names, with its options.

    :raises ConfigError: for a config built in code without a name (a recipe's is
        refused before, by ``from_recipe``).
    """
    from nexrl_core.plugins.registry import get_advantage_estimator

    name = config.advantage.name
    if name is None:
        raise ConfigError(["algorithm.advantage.name: not set; `nexrl plugins` lists the installed advantage estimators"])
    return get_advantage_estimator(name, config.advantage_options)


def check_teacher(estimator: Any, config: HolderTrainerConfig) -> None:
    """A teacher is there exactly when ``estimator`` reads its log-probs: one the estimator
    needs and lacks would fail at step 1, one it ignores would be silently dropped.

    :raises ConfigError: naming ``algorithm.advantage.name`` or ``teacher.model``.
    """
    reads_teacher = TEACHER_LOGPROBS in estimator.requires
    name = config.advantage.name
    if reads_teacher and config.teacher.model is None:
        raise ConfigError(
            [f"algorithm.advantage.name: {name!r} reads a teacher model's log-probs; set teacher.model (the model to distil from)"]
        )
    if not reads_teacher and config.teacher.model is not None:
        raise ConfigError(
            [
                f"teacher.model: advantage estimator {name!r} reads no teacher log-probs, so the teacher would be "
                "ignored; choose an estimator that does (nexrl plugins lists them) or remove teacher"
            ]
        )


class HolderTrainer:
    """Advantages locally, forward-backward and the optimizer step on the service holder,
    whichever backend holds it (named for what it drives, not for one backend)."""

    supports_kl = False
    """Whether `shape_rewards` applies ``algorithm.kl``; a flavour that does sets it."""

    def __init__(self, config: HolderTrainerConfig | None = None) -> None:
        self.config = config or HolderTrainerConfig()
        self.train_step = self.config.train_step
        if self.config.kl.coef > 0 and not self.supports_kl:
            raise ConfigError(
                [
                    f"algorithm.kl.coef: trainer {type(self).__name__} applies no KL penalty; set it to 0 or "
                    "choose a trainer that does (nexrl plugins lists the registered trainers)"
                ]
            )
        self._estimator: Any = None
        self._changed = False
        check_teacher(self.estimator, self.config)

    @property
    def estimator(self) -> Any:
        if self._estimator is None:
            self._estimator = build_estimator(self.config)
        return self._estimator

    def shape_rewards(
        self, holder: ServiceHolder, trajectories: Sequence[Trajectory], batch: Batch, token_rewards: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Per-token rewards the estimator sees (the outcome reward sits on each row's last
        trained token) and metrics; flavours add terms here. The default changes nothing."""
        return token_rewards, {}

    def compute_advantages(self, holder: ServiceHolder, trajectories: Sequence[Trajectory]) -> tuple[list[list[float]], dict[str, float]]:
        """Per-token advantages aligned with each trajectory's tokens, and the metrics of
        reward shaping and of the estimator."""
        from nexrl_core.training.batch import Batch

        batch = Batch.from_trajectories(trajectories, pad_token_id=0)
        inputs = batch.to_advantage_inputs()
        if TEACHER_LOGPROBS in self.estimator.requires:
            teacher = cast(TeacherHolder, holder).teacher_logprobs([trajectory.tokens for trajectory in trajectories])
            inputs = attrs.evolve(inputs, teacher_logprobs=batch.token_values(trajectories, teacher))
        token_rewards, metrics = self.shape_rewards(holder, trajectories, batch, inputs.token_rewards)
        output = self.estimator(attrs.evolve(inputs, token_rewards=token_rewards))
        metrics.update({key: float(value) for key, value in output.metrics.items()})
        table = output.advantages.detach().to("cpu").double()
        prompt_length = batch.prompt_length
        advantages = []
        for row, trajectory in enumerate(trajectories):
            start = next((i for i, flag in enumerate(trajectory.loss_mask) if flag == 1), len(trajectory.tokens))
            offset = prompt_length - start
            values = table[row, offset : offset + len(trajectory.tokens)].tolist()
            advantages.append([value * flag for value, flag in zip(values, trajectory.loss_mask)])
        return advantages, metrics

    def to_datums(self, trajectories: Sequence[Trajectory], advantages: Sequence[Sequence[float]]) -> tuple[list[RemoteDatum], int]:
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

    def extra_metrics(self, trajectories: Sequence[Trajectory], advantages: Sequence[Sequence[float]]) -> dict[str, float]:
        """Flavour-specific metrics; subclasses add to them."""
        return {}

    def train(self, holder: ServiceHolder, trajectories: Sequence[Trajectory], step: int) -> dict[str, float]:
        ordered = sort_trajectories(trajectories)
        metrics: dict[str, float] = {}
        self._changed = False
        if not ordered:
            return {"datums/trained": 0.0, "datums/skipped": 0.0}
        advantages, estimator_metrics = self.compute_advantages(holder, ordered)
        metrics.update(estimator_metrics)
        metrics.update(self.extra_metrics(ordered, advantages))
        datums, skipped = self.to_datums(ordered, advantages)
        metrics["datums/trained"] = float(len(datums))
        metrics["datums/skipped"] = float(skipped)
        metrics["datums/trained_tokens"] = float(sum(sum(datum.loss_mask) for datum in datums))
        if datums:
            train_step = step_with_scheduled_rate(self.train_step, self.config.lr_schedule, step)
            metrics["optim/lr"] = train_step.optimizer.learning_rate
            result = holder.train(datums, train_step)
            metrics.update(readable_train_metrics(result))
            self._changed = True
        return metrics

    def sync_weights(self, holder: ServiceHolder, step: int) -> str | None:
        if not self._changed:
            return None
        self._changed = False
        return holder.update_sampling_weights()

    def state(self) -> dict[str, Any]:
        """Nothing beyond the holder's checkpoint; flavours with state (a KL controller) add it."""
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what `state` returned."""
