"""Policy losses: PPO, importance sampling, cross-entropy, CISPO, GSPO and DRO.

Each loss builds a [B, T] tensor of per-token losses and reduces it with `aggregate`, so
the reduction mode means the same for all of them. Inputs are zeroed off the mask before
any arithmetic: a NaN logprob on a padding token then cannot leak into the loss or, via
``0 * inf`` in the backward pass, into the gradient.

The loss mask is a signed weight, as Tinker's cross-entropy (``-sum w * logp``) has it:
``forward_backward_custom`` sends minus the gradient of the user's loss as weights, so a
loss that pushes a logprob down (DPO's rejected answer) sends negative ones. A token is
trained where its weight is non-zero; the magnitude |w| is what counts it (divisors,
metric weighting), the sign only flips the direction of its loss.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import torch

from nexrl_core.training.algorithms import PolicyLossInputs, PolicyLossOutput, StepTotals, check_inputs_present
from nexrl_grpo.aggregation import aggregate, masked_mean
from nexrl_grpo.config import (
    CispoLossConfig,
    CrossEntropyLossConfig,
    DroLossConfig,
    GspoLossConfig,
    ImportanceSamplingLossConfig,
    PPOLossConfig,
)

__all__ = [
    "CispoLoss",
    "CrossEntropyLoss",
    "DroLoss",
    "GspoLoss",
    "ImportanceSamplingLoss",
    "PPOLoss",
]

_WHAT = "policy loss"
_LOG_RATIO_LIMIT = 20.0
"""Log ratios are clamped to ±20 before exp: e^20 is already far outside any clip range,
and an unclamped ratio from a stale sample would overflow to inf."""


@attrs.frozen(kw_only=True)
class _Tokens:
    """Checked inputs in the compute dtype, each zeroed where ``trained`` is false."""

    logprobs: torch.Tensor
    weights: torch.Tensor
    """[B, T] signed loss_mask in the compute dtype."""
    trained: torch.Tensor
    """[B, T] bool: ``weights != 0``."""
    old_logprobs: torch.Tensor | None
    advantages: torch.Tensor | None
    entropy: torch.Tensor | None
    totals: StepTotals | None
    """The whole step's divisors when these rows are part of it (see `aggregate`)."""

    def log_ratio(self) -> torch.Tensor:
        """log(pi / pi_old), clamped to ±20 (see ``_LOG_RATIO_LIMIT``)."""
        assert self.old_logprobs is not None
        return (self.logprobs - self.old_logprobs).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)

    def mean(self, values: torch.Tensor) -> float:
        """Mean over trained tokens weighted by |w|, as a detached float, for metrics (a
        negative weight reverses a token's loss, not its share of a diagnostic)."""
        return float(masked_mean(values.detach(), self.weights.abs()))

    def fraction(self, condition: torch.Tensor) -> float:
        """Weighted fraction of trained tokens where ``condition`` holds."""
        return self.mean(condition.to(self.weights.dtype))


def _prepare(name: str, requires: frozenset[str], inputs: PolicyLossInputs, entropy_coeff: float) -> _Tokens:
    """Check presence, shapes and finiteness, upcast to at least float32 and zero the padding."""
    check_inputs_present(_WHAT, name, requires, inputs)
    if entropy_coeff > 0 and inputs.entropy is None:
        raise ValueError(
            f"{_WHAT} {name!r} has entropy_coeff={entropy_coeff} but the batch carries no entropy; "
            f"fill PolicyLossInputs.entropy or set entropy_coeff to 0"
        )
    logprobs, mask = inputs.logprobs, inputs.loss_mask
    if logprobs.dim() != 2:
        raise ValueError(f"{_WHAT} {name!r}: logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    shape = tuple(logprobs.shape)
    if tuple(mask.shape) != shape:
        raise ValueError(f"{_WHAT} {name!r}: loss_mask must have logprobs' shape {shape}, got {tuple(mask.shape)}")
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    weights = mask.detach().to(dtype)
    bad_mask = int((~torch.isfinite(weights)).sum())
    if bad_mask:
        raise ValueError(f"{_WHAT} {name!r}: loss_mask has {bad_mask} NaN or inf entries")
    trained = weights != 0
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)

    def checked(field: str, tensor: torch.Tensor) -> torch.Tensor:
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{_WHAT} {name!r}: {field} must have logprobs' shape {shape}, got {tuple(tensor.shape)}")
        bad = int((trained & ~torch.isfinite(tensor.detach())).sum())
        if bad:
            raise ValueError(f"{_WHAT} {name!r}: {field} has {bad} NaN or inf entries where loss_mask != 0")
        return torch.where(trained, tensor.to(dtype), zero)

    def optional(field: str) -> torch.Tensor | None:
        tensor = getattr(inputs, field)
        return None if tensor is None else checked(field, tensor)

    return _Tokens(
        logprobs=checked("logprobs", logprobs),
        weights=weights,
        trained=trained,
        old_logprobs=optional("old_logprobs"),
        advantages=optional("advantages"),
        entropy=optional("entropy"),
        totals=inputs.step_totals,
    )


def _approx_kl(tokens: _Tokens, log_ratio: torch.Tensor) -> dict[str, float]:
    """k3 estimate of KL(pi_old || pi): mean of (r - 1) - log r, non-negative per token."""
    return {"approx_kl": tokens.mean(torch.expm1(log_ratio) - log_ratio)}


def _ratio_stats(tokens: _Tokens, ratio: torch.Tensor) -> dict[str, float]:
    """Importance-ratio diagnostics over trained tokens; min/max are 1 when nothing is trained."""
    trained_ratios = ratio.detach()[tokens.trained]
    has_tokens = trained_ratios.numel() > 0
    return {
        "ratio/mean": tokens.mean(ratio),
        "ratio/min": float(trained_ratios.min()) if has_tokens else 1.0,
        "ratio/max": float(trained_ratios.max()) if has_tokens else 1.0,
    }


def _clipped_surrogate(
    advantages: torch.Tensor, ratio: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high)), and where the
    clipped term is the larger one (the token then gets no gradient)."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _finish(
    loss_tokens: torch.Tensor,
    tokens: _Tokens,
    config: Any,
    entropy_coeff: float,
    metrics: dict[str, float],
) -> PolicyLossOutput:
    """Aggregate, subtract the entropy bonus and attach the loss and entropy metrics."""
    loss = aggregate(loss_tokens, tokens.weights, config.agg_mode, config.norm_constant, tokens.totals)
    metrics["loss"] = float(loss.detach())
    if tokens.entropy is not None:
        entropy = aggregate(tokens.entropy, tokens.weights, config.agg_mode, config.norm_constant, tokens.totals)
        metrics["entropy"] = float(entropy.detach())
        if entropy_coeff > 0:
            loss = loss - entropy_coeff * entropy
    return PolicyLossOutput(loss=loss, metrics=metrics)


class PPOLoss:
    """PPO clipped surrogate: max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high)) per token,
    optionally capped at -A * dual_clip_c where A < 0 (dual clip)."""

    name: ClassVar[str] = "ppo"
    requires: ClassVar[frozenset[str]] = frozenset({"old_logprobs", "advantages"})

    def __init__(self, config: PPOLossConfig) -> None:
        self.config = config

    def __call__(self, inputs: PolicyLossInputs) -> PolicyLossOutput:
        config = self.config
        tokens = _prepare(self.name, self.requires, inputs, config.entropy_coeff)
        advantages = tokens.advantages
        assert advantages is not None
        log_ratio = tokens.log_ratio()
        ratio = torch.exp(log_ratio)
        loss_tokens, clip_active = _clipped_surrogate(advantages, ratio, config.clip_low, config.clip_high)
        metrics = {
            "clip_frac": tokens.fraction(clip_active),
            "clip_frac/low": tokens.fraction(clip_active & (ratio < 1.0)),
            "clip_frac/high": tokens.fraction(clip_active & (ratio > 1.0)),
            **_approx_kl(tokens, log_ratio),
            **_ratio_stats(tokens, ratio),
        }
        if config.dual_clip_c is not None:
            cap = -advantages * config.dual_clip_c
            dual_active = (advantages < 0) & (loss_tokens > cap)
            loss_tokens = torch.where(dual_active, cap, loss_tokens)
            metrics["dual_clip_frac"] = tokens.fraction(dual_active)
        return _finish(loss_tokens, tokens, config, config.entropy_coeff, metrics)


class ImportanceSamplingLoss:
    """Unclipped off-policy policy gradient: -r * A per token."""

    name: ClassVar[str] = "importance_sampling"
    requires: ClassVar[frozenset[str]] = frozenset({"old_logprobs", "advantages"})

    def __init__(self, config: ImportanceSamplingLossConfig) -> None:
        self.config = config

    def __call__(self, inputs: PolicyLossInputs) -> PolicyLossOutput:
        config = self.config
        tokens = _prepare(self.name, self.requires, inputs, config.entropy_coeff)
        assert tokens.advantages is not None
        log_ratio = tokens.log_ratio()
        ratio = torch.exp(log_ratio)
        metrics = {**_approx_kl(tokens, log_ratio), **_ratio_stats(tokens, ratio)}
        return _finish(-ratio * tokens.advantages, tokens, config, config.entropy_coeff, metrics)


class CrossEntropyLoss:
    """Weighted negative log-likelihood: -w * logp per token with signed w (see the module
    docstring), so under ``token-sum`` the loss is Tinker's ``-sum w * logp``."""

    name: ClassVar[str] = "cross_entropy"
    requires: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, config: CrossEntropyLossConfig) -> None:
        self.config = config

    def __call__(self, inputs: PolicyLossInputs) -> PolicyLossOutput:
        tokens = _prepare(self.name, self.requires, inputs, 0.0)
        return _finish(-tokens.logprobs, tokens, self.config, 0.0, {})


class CispoLoss:
    """CISPO: -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logp per token.

    The clipped ratio is a constant weight, so every token keeps a gradient through
    logp, including those PPO would clip away.
    """

    name: ClassVar[str] = "cispo"
    requires: ClassVar[frozenset[str]] = frozenset({"old_logprobs", "advantages"})

    def __init__(self, config: CispoLossConfig) -> None:
        self.config = config

    def __call__(self, inputs: PolicyLossInputs) -> PolicyLossOutput:
        config = self.config
        tokens = _prepare(self.name, self.requires, inputs, config.entropy_coeff)
        assert tokens.advantages is not None
        log_ratio = tokens.log_ratio()
        ratio = torch.exp(log_ratio)
        low, high = 1.0 - config.clip_low, 1.0 + config.clip_high
        weight = ratio.clamp(low, high).detach()
        metrics = {
            "clip_frac": tokens.fraction((ratio < low) | (ratio > high)),
            **_approx_kl(tokens, log_ratio),
            **_ratio_stats(tokens, ratio),
        }
        loss_tokens = -weight * tokens.advantages * tokens.logprobs
        return _finish(loss_tokens, tokens, config, config.entropy_coeff, metrics)


class GspoLoss:
    """GSPO (token form): PPO clipping on the sequence ratio s = exp(mean_t log r).

    Each token carries s_t = sg(s) * exp(logp - sg(logp)), equal to s in value, so the
    gradient of a token is s * grad(logp) and the clipping decision is per sequence.
    """

    name: ClassVar[str] = "gspo"
    requires: ClassVar[frozenset[str]] = frozenset({"old_logprobs", "advantages"})

    def __init__(self, config: GspoLossConfig) -> None:
        self.config = config

    def __call__(self, inputs: PolicyLossInputs) -> PolicyLossOutput:
        config = self.config
        tokens = _prepare(self.name, self.requires, inputs, config.entropy_coeff)
        advantages = tokens.advantages
        assert advantages is not None
        log_ratio = tokens.log_ratio()
        magnitudes = tokens.weights.abs()
        row_weights = magnitudes.sum(dim=-1)
        row_weights = torch.where(row_weights > 0, row_weights, torch.ones_like(row_weights))
        sequence_log_ratio = (log_ratio * magnitudes).sum(dim=-1) / row_weights
        sequence_ratio = torch.exp(sequence_log_ratio).detach()[:, None]
        token_ratio = sequence_ratio * torch.exp(tokens.logprobs - tokens.logprobs.detach())
        loss_tokens, clip_active = _clipped_surrogate(advantages, token_ratio, config.clip_low, config.clip_high)
        metrics = {
            "clip_frac": tokens.fraction(clip_active),
            **_approx_kl(tokens, log_ratio),
            **_ratio_stats(tokens, token_ratio),
        }
        return _finish(loss_tokens, tokens, config, config.entropy_coeff, metrics)


class DroLoss:
    """DRO (Richemond et al. 2024; Kimi k1.5): -(A * logp - beta / 2 * (logp - logq)^2)
    per token, q the sampler.

    The plain ``A * logp`` term is an off-policy gradient without an importance ratio;
    the quadratic penalty keeps the policy near the sampler instead of clipping. The
    penalty counts where the loss mask does, since a Tinker datum's sampler logprobs
    on the prompt are 0 placeholders, not the sampler's values.
    """

    name: ClassVar[str] = "dro"
    requires: ClassVar[frozenset[str]] = frozenset({"old_logprobs", "advantages"})

    def __init__(self, config: DroLossConfig) -> None:
        self.config = config

    def __call__(self, inputs: PolicyLossInputs) -> PolicyLossOutput:
        config = self.config
        tokens = _prepare(self.name, self.requires, inputs, 0.0)
        assert tokens.advantages is not None and tokens.old_logprobs is not None
        drift = tokens.logprobs - tokens.old_logprobs
        loss_tokens = -(tokens.advantages * tokens.logprobs - 0.5 * config.beta * drift.square())
        log_ratio = tokens.log_ratio()
        metrics = {
            "quadratic_penalty": tokens.mean(0.5 * drift.square()),
            **_approx_kl(tokens, log_ratio),
            **_ratio_stats(tokens, torch.exp(log_ratio)),
        }
        return _finish(loss_tokens, tokens, config, 0.0, metrics)
