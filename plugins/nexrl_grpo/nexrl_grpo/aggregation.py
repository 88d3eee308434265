"""Reduce a [B, T] tensor of per-token losses to the scalar that is back-propagated.

Every loss (and the entropy bonus) goes through `aggregate` so that the modes mean the
same thing everywhere and padding is handled in one place: a row whose weights are all
zero (a prompt-only row, or a row appended to even out data-parallel ranks) never counts,
and a batch with nothing to train gives an exact 0 that is still part of the graph.

When the rows are only part of a step (a micro-batch, a rank's share), the step's
`StepTotals` replace the rows' own counts as divisors: every mode is then a sum over
rows and tokens divided by step-wide numbers, so the parts' results add up to the
whole step's, whatever the split.
"""

from __future__ import annotations

import torch

from nexrl_core.training.algorithms import StepTotals
from nexrl_grpo.config import AggMode

__all__ = ["aggregate", "masked_mean"]


def _safe_divisor(denominator: torch.Tensor) -> torch.Tensor:
    """Replace zero divisors by 1; the matching numerators are exactly 0 there."""
    return torch.where(denominator > 0, denominator, torch.ones_like(denominator))


def aggregate(
    loss_tokens: torch.Tensor,
    mask: torch.Tensor,
    mode: AggMode | str,
    norm_constant: float | None = None,
    totals: StepTotals | None = None,
) -> torch.Tensor:
    """Reduce ``loss_tokens`` [B, T] weighted by ``mask`` [B, T] to a scalar.

    Weights may be negative (a token whose loss is to be pushed the other way); every
    divisor counts them by magnitude |w|, so a mean stays a mean of |w|-weighted terms.

    ``token-mean``: sum(l*w) / sum(|w|).
    ``seq-mean-token-mean``: sum over rows of sum_t(l*w) / sum_t(|w|), over the rows with weight.
    ``seq-mean-token-sum``: sum over rows of sum_t(l*w), over the rows with weight.
    ``seq-mean-token-sum-norm``: sum over rows of sum_t(l*w) / norm_constant, over the
    rows with weight (default norm_constant: T, the longest row).
    ``token-sum``: sum(l*w).

    The divisors sum(w), "the rows with weight" and T are the step's ``totals`` when
    given, else this batch's own. Positions with zero weight are dropped before
    multiplying, so a NaN or inf there changes neither the value nor the gradient.
    """
    try:
        mode = AggMode(mode)
    except ValueError:
        valid = ", ".join(repr(m.value) for m in AggMode)
        raise ValueError(f"unknown aggregation mode {mode!r}; choose one of {valid}") from None
    if loss_tokens.dim() != 2 or mask.shape != loss_tokens.shape:
        raise ValueError(
            f"aggregate needs loss_tokens and mask of the same [B, T] shape, got {tuple(loss_tokens.shape)} and {tuple(mask.shape)}"
        )
    if norm_constant is not None and not norm_constant > 0:
        raise ValueError(f"norm_constant must be > 0, got {norm_constant!r}")

    weights = mask.to(loss_tokens.dtype)
    weighted = torch.where(weights != 0, loss_tokens * weights, torch.zeros_like(loss_tokens))
    if totals is None:
        totals = StepTotals.of(weights)

    if mode is AggMode.TOKEN_SUM:
        return weighted.sum()
    if mode is AggMode.TOKEN_MEAN:
        return weighted.sum() / _positive_or_one(totals.tokens)

    row_sums = weighted.sum(dim=-1)
    if mode is AggMode.SEQ_MEAN_TOKEN_MEAN:
        per_row = row_sums / _safe_divisor(weights.abs().sum(dim=-1))
    elif mode is AggMode.SEQ_MEAN_TOKEN_SUM:
        per_row = row_sums
    else:
        per_row = row_sums / (norm_constant or max(totals.columns, 1))
    return per_row.sum() / _positive_or_one(totals.sequences)


def _positive_or_one(total: float) -> float:
    """A step total as a divisor: 1 when the step has nothing to train (its sums are 0)."""
    return total if total > 0 else 1.0


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Weighted mean of ``values`` over a non-negative ``mask`` (0 when nothing is
    weighted); for metrics."""
    return aggregate(values, mask, AggMode.TOKEN_MEAN)
