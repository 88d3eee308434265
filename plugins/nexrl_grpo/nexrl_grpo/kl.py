"""KL(policy || reference) penalties and the controllers that weight them.

The penalty keeps the policy near the reference model. It is estimated per token from
two logprobs (no full distributions are kept), and its coefficient is either fixed or
adapted so that the measured KL tracks a target, as in Ziegler et al. (2019).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Union

import attrs
import torch

from nexrl_core.config.schema import KLController as KLControllerKind
from nexrl_core.config.schema import KLPenalty as KLPenaltyKind
from nexrl_core.config.schema import KLSettings

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "KLInReward",
    "build_kl_controller",
    "kl_penalty",
]

_EXP_INPUT_LIMIT = 20.0
"""``low_var_kl`` exponentiates a log ratio; beyond e^20 the estimate is meaningless and
float32 starts to lose it, so the input is clamped first."""
_LOW_VAR_KL_LIMIT = 10.0
"""Cap on a single token's ``low_var_kl`` so one wildly off token cannot dominate."""


def _check(requirement: str, ok: Callable[[float], bool]) -> Callable[[Any, attrs.Attribute, Any], None]:
    """Validator whose message uses the constructor's argument name, not the attribute's."""

    def validate(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not (isinstance(value, (int, float)) and math.isfinite(value) and ok(value)):
            raise ValueError(f"{type(instance).__name__} {attribute.alias} must be {requirement}, got {value!r}")

    return validate


@attrs.define
class FixedKLController:
    """Keeps the KL coefficient constant."""

    value: float = attrs.field(alias="coef", converter=float, validator=_check(">= 0", lambda v: v >= 0))
    """The coefficient."""

    def update(self, current_kl: float, n_steps: int) -> None:
        """Does nothing; present so both controllers can be driven the same way."""


@attrs.define
class AdaptiveKLController:
    """Moves the coefficient towards keeping the measured KL at ``target_kl``.

    The relative error is clipped to ±20% so a single noisy measurement moves the
    coefficient by at most ``0.2 * n_steps / horizon`` of its value.
    """

    value: float = attrs.field(alias="init_coef", converter=float, validator=_check(">= 0", lambda v: v >= 0))
    """The current coefficient (starts at ``init_coef``)."""
    target_kl: float = attrs.field(converter=float, validator=_check("> 0", lambda v: v > 0))
    """KL per token to aim for."""
    horizon: int = attrs.field(validator=_check("> 0", lambda v: v > 0))
    """Steps over which a persistent error of +20% (or more) raises the coefficient by about 20%."""

    def update(self, current_kl: float, n_steps: int) -> None:
        """Scale the coefficient by ``1 + clip(kl/target - 1, -0.2, 0.2) * n_steps / horizon``."""
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


KLController = Union[FixedKLController, AdaptiveKLController]


def build_kl_controller(config: KLSettings) -> KLController:
    """Build the controller ``config.controller`` names, starting at ``config.coef``."""
    if config.controller is KLControllerKind.ADAPTIVE:
        return AdaptiveKLController(init_coef=config.coef, target_kl=config.target, horizon=config.horizon)
    return FixedKLController(coef=config.coef)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLPenaltyKind | str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference), same shape as the inputs.

    ``kl``: logp - ref. ``abs``: |logp - ref|. ``mse``: 0.5 * (logp - ref)^2.
    ``low_var_kl``: exp(k) - k - 1 with k = ref - logp (clamped to ±20), the result
    clamped to [-10, 10].
    """
    try:
        kind = KLPenaltyKind(kind)
    except ValueError:
        valid = ", ".join(repr(k.value) for k in KLPenaltyKind)
        raise ValueError(f"unknown KL penalty kind {kind!r}; choose one of {valid}") from None
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"kl_penalty needs logprobs and ref_logprobs of the same shape, got {tuple(logprobs.shape)} and {tuple(ref_logprobs.shape)}"
        )
    log_ratio = logprobs - ref_logprobs
    if kind is KLPenaltyKind.KL:
        return log_ratio
    if kind is KLPenaltyKind.ABS:
        return log_ratio.abs()
    if kind is KLPenaltyKind.MSE:
        return 0.5 * log_ratio.square()
    k = (-log_ratio).clamp(-_EXP_INPUT_LIMIT, _EXP_INPUT_LIMIT)
    return (torch.exp(k) - k - 1.0).clamp(-_LOW_VAR_KL_LIMIT, _LOW_VAR_KL_LIMIT)


class KLInReward:
    """``algorithm.kl`` applied in the reward, shared by the GRPO trainers of every backend.

    Per trained token ``reward -= coef * penalty(logprobs, ref_logprobs)``, with ``coef``
    the controller's value before this step; the controller then moves it by the KL just
    measured (per trained token, before the coefficient), which `apply` reports as
    ``kl/mean`` beside ``kl/coef``.
    """

    def __init__(self, settings: KLSettings) -> None:
        self.settings = settings
        self.controller = build_kl_controller(settings)

    def apply(
        self,
        token_rewards: torch.Tensor,
        logprobs: torch.Tensor,
        ref_logprobs: torch.Tensor,
        loss_mask: torch.Tensor,
        rows: int,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The shaped [B, T] rewards and the step's KL metrics; all inputs share one
        column layout. ``rows`` is how many real rows the step trained (the adaptive
        controller's ``n_steps``)."""
        mask = loss_mask.to(torch.float64)
        kl = kl_penalty(logprobs.to(torch.float64), ref_logprobs.to(torch.float64), self.settings.penalty) * mask
        coef = self.controller.value
        shaped = token_rewards - (coef * kl).to(token_rewards.dtype)
        tokens = float(mask.sum())
        kl_mean = float(kl.sum()) / tokens if tokens else 0.0
        self.controller.update(kl_mean, n_steps=rows)
        return shaped, {"kl/mean": kl_mean, "kl/coef": coef}

    def state(self) -> dict[str, float]:
        """The coefficient, which ``--resume`` must restore (the adaptive one moves)."""
        return {"kl_coef": self.controller.value}

    def load_state(self, state: dict[str, Any]) -> None:
        if "kl_coef" in state:
            self.controller.value = float(state["kl_coef"])
