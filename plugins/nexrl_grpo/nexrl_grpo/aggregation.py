"""Reduce a [B, T] tensor of per-token losses to the scalar that is back-propagated.

Every loss (and the entropy bonus) goes through `aggregate` so that the modes mean the
same thing everywhere and padding is handled in one place: a row whose weights are all
zero (a prompt-only row, or a row appended to even out data-parallel ranks) never counts,
and a batch with nothing to train gives an exact 0 that is still part of the graph.
"""

from __future__ import annotations

import torch

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
) -> torch.Tensor:
    """Reduce ``loss_tokens`` [B, T] weighted by ``mask`` [B, T] (non-negative) to a scalar.

    ``token-mean``: sum(l*w) / sum(w).
    ``seq-mean-token-mean``: mean over rows with weight of sum_t(l*w) / sum_t(w).
    ``seq-mean-token-sum``: mean over rows with weight of sum_t(l*w).
    ``seq-mean-token-sum-norm``: mean over rows with weight of sum_t(l*w) / norm_constant
    (default: T, the column count).
    ``token-sum``: sum(l*w).

    Positions with zero weight are dropped before multiplying, so a NaN or inf there
    changes neither the value nor the gradient.
    """
    try:
        mode = AggMode(mode)
    except ValueError:
        valid = ", ".join(repr(m.value) for m in AggMode)
        raise ValueError(f"unknown aggregation mode {mode!r}; choose one of {valid}") from None
    if loss_tokens.dim() != 2 or mask.shape != loss_tokens.shape:
        raise ValueError(
            f"aggregate needs loss_tokens and mask of the same [B, T] shape, "
            f"got {tuple(loss_tokens.shape)} and {tuple(mask.shape)}"
        )
    if norm_constant is not None and not norm_constant > 0:
        raise ValueError(f"norm_constant must be > 0, got {norm_constant!r}")

    weights = mask.to(loss_tokens.dtype)
    weighted = torch.where(weights != 0, loss_tokens * weights, torch.zeros_like(loss_tokens))

    if mode is AggMode.TOKEN_SUM:
        return weighted.sum()
    if mode is AggMode.TOKEN_MEAN:
        return weighted.sum() / _safe_divisor(weights.sum())

    row_sums = weighted.sum(dim=-1)
    row_weights = weights.sum(dim=-1)
    rows_with_weight = _safe_divisor((row_weights > 0).sum().to(loss_tokens.dtype))
    if mode is AggMode.SEQ_MEAN_TOKEN_MEAN:
        per_row = row_sums / _safe_divisor(row_weights)
    elif mode is AggMode.SEQ_MEAN_TOKEN_SUM:
        per_row = row_sums
    else:
        per_row = row_sums / (norm_constant or max(loss_tokens.shape[-1], 1))
    return per_row.sum() / rows_with_weight


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Weighted mean of ``values`` over ``mask`` (0 when nothing is weighted); for metrics."""
    return aggregate(values, mask, AggMode.TOKEN_MEAN)
