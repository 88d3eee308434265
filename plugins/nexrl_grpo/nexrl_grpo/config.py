"""Option classes for the estimators, losses and KL control this plugin registers.

They are plain attrs classes so the core can structure a recipe's YAML into them and
reject a bad value when the config is loaded, long before a GPU is touched. This module
must not import torch or numpy: ``nexrl plugins`` and config validation import it on
machines that have neither.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import Any, TypeVar

import attrs

from nexrl_core.training.holder_trainer import HolderTrainerConfig
from nexrl_core.training.self_hosted import UpdateSettings

E = TypeVar("E", bound=enum.Enum)


class AggMode(str, enum.Enum):
    """How per-token losses are reduced to one scalar.

    The mode decides how much each sequence and each token weighs in the gradient, so it
    is part of the algorithm (Dr. GRPO and GSPO differ from PPO partly here).
    """

    TOKEN_MEAN = "token-mean"
    """Weighted mean over every trained token of the batch: long answers weigh more."""
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    """Mean over rows of each row's weighted token mean: every sequence weighs the same."""
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    """Mean over rows of each row's weighted token sum (a true sum, not a mean)."""
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"
    """Like ``seq-mean-token-sum`` but each row sum is divided by a constant (Dr. GRPO),
    so the scale does not depend on answer length."""
    TOKEN_SUM = "token-sum"
    """Plain weighted sum over every trained token, the reduction Tinker's losses use."""


def _enum_converter(enum_class: type[E]) -> Callable[[Any], E]:
    """Accept an enum member or its string value and say which values exist on a typo."""

    def convert(value: Any) -> E:
        try:
            return enum_class(value)
        except ValueError:
            valid = ", ".join(repr(member.value) for member in enum_class)
            raise ValueError(f"{value!r} is not a valid {enum_class.__name__}; choose one of {valid}") from None

    return convert


def _number(requirement: str, check: Callable[[float], bool]) -> Callable[[Any, attrs.Attribute, Any], None]:
    """Build a validator that names the class, the field, the rule and the bad value."""

    def validate(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and check(value)
        if not ok:
            raise ValueError(f"{type(instance).__name__}.{attribute.name} must be {requirement}, got {value!r}")

    return validate


def _bool(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """Reject strings like ``"false"`` that would otherwise be truthy."""
    if not isinstance(value, bool):
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must be true or false, got {value!r}")


_positive = _number("a finite number > 0", lambda v: v > 0)
_non_negative = _number("a finite number >= 0", lambda v: v >= 0)
_clip_low = _number("in (0, 1] so that 1 - clip_low stays >= 0", lambda v: 0 < v <= 1)
_dual_clip = attrs.validators.optional(_number("> 1 (or null to disable dual clipping)", lambda v: v > 1))
_discount = _number("in [0, 1]", lambda v: 0 <= v <= 1)
_to_agg_mode = _enum_converter(AggMode)


# --- advantage estimators ----------------------------------------------------------------


def _read_when_dividing_by_std(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """``eps`` is added to the std, so without ``norm_by_std`` it would be accepted and ignored."""
    if not instance.norm_by_std and value != attribute.default:
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} is read only with norm_by_std true; set it or remove {attribute.name}"
        )


@attrs.frozen(kw_only=True)
class GrpoConfig:
    """Options of ``grpo``: group-normalised outcome advantages."""

    norm_by_std: bool = attrs.field(default=True, validator=_bool)
    """Divide by the group's std of run scores; false gives the mean-centred advantage only."""
    eps: float = attrs.field(default=1e-6, validator=[_positive, _read_when_dividing_by_std])
    """Added to the std so a group with a tiny spread cannot blow advantages up (read
    only with ``norm_by_std``)."""


@attrs.frozen(kw_only=True)
class DrGrpoConfig:
    """Options of ``dr_grpo`` (none yet): score minus the group mean, no std division,
    which removes GRPO's bias towards groups with a small spread."""


@attrs.frozen(kw_only=True)
class RlooConfig:
    """Options of ``rloo`` (none yet): the baseline of a run is the mean of the other
    runs in its group, so a run never baselines against itself."""


@attrs.frozen(kw_only=True)
class ReinforcePlusPlusConfig:
    """Options of ``reinforce_plus_plus``: discounted returns whitened over the batch."""

    gamma: float = attrs.field(default=1.0, validator=_discount)
    """Discount per trained token; 1 makes every token's return the rest of the row's reward."""
    eps: float = attrs.field(default=1e-8, validator=_positive)
    """Added to the batch std before whitening so a constant batch gives 0, not NaN."""


class TaskAdvantage(str, enum.Enum):
    """Which group-relative advantage of the task reward on-policy distillation adds to
    the teacher's, or none."""

    NONE = "none"
    """The teacher's reverse KL alone: pure distillation."""
    GRPO = "grpo"
    """``grpo`` with its default options (normalised by the group's std)."""
    DR_GRPO = "dr_grpo"
    """``dr_grpo``: the score minus the group mean, what the Tinker cookbook adds."""
    RLOO = "rloo"
    """``rloo``: the score minus the mean of the group's other runs."""


_task_advantage = _enum_converter(TaskAdvantage)


def _to_task_advantage(value: Any) -> TaskAdvantage:
    """`_enum_converter` of `TaskAdvantage` as a def: mypy's attrs plugin takes a converter
    that is a named function, a type or a lambda, not a call's result."""
    return _task_advantage(value)


@attrs.frozen(kw_only=True)
class OnPolicyDistillationConfig:
    """Options of ``on_policy_distillation``: the student samples, the recipe's teacher
    scores each sampled token, and the negative reverse KL is the student's advantage."""

    kl_coef: float = attrs.field(default=1.0, validator=_positive)
    """Weight of the reverse KL: a token's advantage is ``-kl_coef * (log p_student -
    log p_teacher)`` (v1's ``distillation_coeff``, the cookbook's ``kl_penalty_coef``)."""
    kl_discount: float = attrs.field(default=0.0, validator=_discount)
    """Discount of later tokens' KL: with it above 0 a token's advantage is the discounted
    sum of its own and every later trained token's term, so a token is also blamed for the
    divergence it leads to (the cookbook's ``kl_discount_factor``); 0 keeps each token's own."""
    task_advantage: TaskAdvantage = attrs.field(default=TaskAdvantage.NONE, converter=_to_task_advantage)
    """Add this group-relative advantage of the task reward to the distillation term (the
    task's reward then also teaches); ``none`` distils only."""


# --- policy losses -------------------------------------------------------------------------


def _agg_mode_field(default: AggMode) -> Any:
    return attrs.field(default=default, converter=_to_agg_mode)


def _read_by_its_aggregation(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """``norm_constant`` only divides ``seq-mean-token-sum-norm``; under any other
    aggregation it would be accepted and ignored."""
    if value is not None and instance.agg_mode is not AggMode.SEQ_MEAN_TOKEN_SUM_NORM:
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} is read only by agg_mode {AggMode.SEQ_MEAN_TOKEN_SUM_NORM.value}, "
            f"not {instance.agg_mode.value}; set that agg_mode or remove {attribute.name}"
        )


def _norm_constant_field() -> Any:
    return attrs.field(default=None, validator=[attrs.validators.optional(_positive), _read_by_its_aggregation])


def _entropy_coeff_field() -> Any:
    return attrs.field(default=0.0, validator=_non_negative)


@attrs.frozen(kw_only=True)
class PPOLossConfig:
    """Options of ``ppo``: the clipped surrogate objective."""

    clip_low: float = attrs.field(default=0.2, validator=_clip_low)
    """The ratio is clipped from below at ``1 - clip_low``."""
    clip_high: float = attrs.field(default=0.2, validator=_positive)
    """The ratio is clipped from above at ``1 + clip_high``; raise it (e.g. 0.28) to let
    unlikely tokens grow faster, as DAPO's clip-higher does."""
    dual_clip_c: float | None = attrs.field(default=None, validator=_dual_clip)
    """When set, the loss of a negative-advantage token is capped at ``-A * c`` so a huge
    ratio cannot dominate the batch; must be > 1."""
    agg_mode: AggMode = _agg_mode_field(AggMode.TOKEN_MEAN)
    """How per-token losses are reduced to a scalar."""
    norm_constant: float | None = _norm_constant_field()
    """Divisor of ``seq-mean-token-sum-norm``; null uses the batch's column count T."""
    entropy_coeff: float = _entropy_coeff_field()
    """Weight of the entropy bonus subtracted from the loss; 0 disables it."""


@attrs.frozen(kw_only=True)
class ImportanceSamplingLossConfig:
    """Options of ``importance_sampling``: the unclipped off-policy policy gradient."""

    agg_mode: AggMode = _agg_mode_field(AggMode.TOKEN_MEAN)
    """How per-token losses are reduced to a scalar."""
    norm_constant: float | None = _norm_constant_field()
    """Divisor of ``seq-mean-token-sum-norm``; null uses the batch's column count T."""
    entropy_coeff: float = _entropy_coeff_field()
    """Weight of the entropy bonus subtracted from the loss; 0 disables it."""


@attrs.frozen(kw_only=True)
class CrossEntropyLossConfig:
    """Options of ``cross_entropy``: weighted negative log-likelihood (supervised tuning)."""

    agg_mode: AggMode = _agg_mode_field(AggMode.TOKEN_MEAN)
    """How per-token losses are reduced to a scalar."""
    norm_constant: float | None = _norm_constant_field()
    """Divisor of ``seq-mean-token-sum-norm``; null uses the batch's column count T."""


@attrs.frozen(kw_only=True)
class CispoLossConfig:
    """Options of ``cispo``: clipped importance weights on a REINFORCE gradient, so
    clipped tokens still pass a gradient (unlike PPO, which drops them)."""

    clip_low: float = attrs.field(default=0.2, validator=_clip_low)
    """The importance weight is clipped from below at ``1 - clip_low``; 1 disables it."""
    clip_high: float = attrs.field(default=0.2, validator=_positive)
    """The importance weight is clipped from above at ``1 + clip_high``."""
    agg_mode: AggMode = _agg_mode_field(AggMode.TOKEN_MEAN)
    """How per-token losses are reduced to a scalar."""
    norm_constant: float | None = _norm_constant_field()
    """Divisor of ``seq-mean-token-sum-norm``; null uses the batch's column count T."""
    entropy_coeff: float = _entropy_coeff_field()
    """Weight of the entropy bonus subtracted from the loss; 0 disables it."""


@attrs.frozen(kw_only=True)
class GspoLossConfig:
    """Options of ``gspo``: PPO clipping on a sequence-level (length-normalised) ratio.

    The sequence ratio stays much closer to 1 than token ratios do, hence the small
    clip ranges.
    """

    clip_low: float = attrs.field(default=3e-4, validator=_clip_low)
    """The sequence ratio is clipped from below at ``1 - clip_low``."""
    clip_high: float = attrs.field(default=4e-4, validator=_positive)
    """The sequence ratio is clipped from above at ``1 + clip_high``."""
    agg_mode: AggMode = _agg_mode_field(AggMode.SEQ_MEAN_TOKEN_MEAN)
    """How per-token losses are reduced; the sequence mean matches GSPO's objective."""
    norm_constant: float | None = _norm_constant_field()
    """Divisor of ``seq-mean-token-sum-norm``; null uses the batch's column count T."""
    entropy_coeff: float = _entropy_coeff_field()
    """Weight of the entropy bonus subtracted from the loss; 0 disables it."""


@attrs.frozen(kw_only=True)
class DroLossConfig:
    """Options of ``dro``: Direct Reward Optimization (Richemond et al. 2024), the
    policy gradient on logp with a quadratic penalty on the log ratio to the sampler."""

    beta: float = attrs.field(default=0.05, validator=_non_negative)
    """Weight of the penalty ``beta / 2 * (logp - logq)^2``. 0.05 is the value Tinker's
    documentation passes; hosted Tinker does not publish its own default."""
    agg_mode: AggMode = _agg_mode_field(AggMode.TOKEN_MEAN)
    """How per-token losses are reduced to a scalar."""
    norm_constant: float | None = _norm_constant_field()
    """Divisor of ``seq-mean-token-sum-norm``; null uses the batch's column count T."""


# --- trainers ------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class SelfHostedGrpoConfig(HolderTrainerConfig):
    """The recipe's ``algorithm`` (estimator, loss, KL, AdamW: read by
    `HolderTrainerConfig.from_recipe`) plus how the self-hosted workers update."""

    update: UpdateSettings = attrs.field(factory=UpdateSettings)
    """PPO epochs, mini-batches and micro-batch rows (``backend.options.update``)."""
    recompute_old_logprobs: bool = True
    """Recompute the behaviour policy's logprobs on the workers before the update, so
    the importance ratio compares the trained weights with themselves rather than with
    the sampler's numerics (``backend.options.recompute_old_logprobs``)."""
