"""What bfloat16 compute may change, bounded the same on every CPU.

A bfloat16 forward's result depends on the CPU's kernels: AVX2, AVX-512 BF16 and AMX
accumulate and round in different orders, so two correct bfloat16 runs of one model differ
by a few roundings of each activation. Tests of mixed precision bound that difference by
bfloat16's unit roundoff, never by what one machine happened to print.

A policy loss is a sum of signed per-token terms ``-ratio_t * A_t`` that often nearly
cancels (the tests' sums are ~1e-6 against terms of ~1e-5), so its error is bounded by the
terms' magnitudes, not by the sum: if each token's log-prob is off by at most ``delta``,
each ratio is off by at most ``expm1(delta)`` of itself, and the loss by at most
``expm1(delta) * sum_t |ratio_t * A_t|``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs

__all__ = [
    "BF16_UNIT_ROUNDOFF",
    "BF16_VISIBLE",
    "GRAD_NORM_RELATIVE",
    "LOGPROB_TOLERANCE",
    "abs_advantages",
    "loss_tolerance",
    "max_logprob_gap",
    "trained_tokens",
]

BF16_UNIT_ROUNDOFF = 2.0**-8
"""Half the gap between 1 and the next bfloat16 (8 bits of significand)."""
LOGPROB_TOLERANCE = 32 * BF16_UNIT_ROUNDOFF
"""How far a bfloat16 forward's per-token log-prob may be from fp32's (0.125 nats): the
tiny model's logits pass through every layer's bfloat16 roundings. Measured at most 0.030
(AVX-512 BF16 and AVX2 kernels, 1 and 2 threads), so a quarter of the bound."""
BF16_VISIBLE = 1e-3
"""The least largest per-token gap by which a bfloat16 forward shows against fp32's over a
few dozen tokens (measured at least 0.02); two fp32 forwards that add up in other orders
agree within 1e-5, so a gap above this says the side computed in bfloat16."""
GRAD_NORM_RELATIVE = 2e-2
"""How far, relatively, a gradient norm computed in bfloat16 may be from another computed
in bfloat16 on other kernels or splits, or from fp32's (5 bfloat16 roundoffs). Measured:
0.3 % between two ranks and one engine on AVX2 kernels, 0.01 % on AVX-512 BF16."""
FP32_SUM_ROUNDOFF = 64 * 2.0**-24
"""How much of its terms' magnitude an fp32 sum of a few hundred terms may change with the
order it is added up in (measured 2e-8 between two ranks and one engine)."""


def abs_advantages(datums: Sequence[Any]) -> list[Any]:
    """``datums`` with every advantage replaced by its magnitude: a loss over them is minus
    the sum of its terms' magnitudes, whatever the loss's aggregation."""
    return [
        attrs.evolve(datum, loss_fn_inputs={**datum.loss_fn_inputs, "advantages": [abs(a) for a in datum.loss_fn_inputs["advantages"]]})
        for datum in datums
    ]


def loss_tolerance(terms_magnitude: float, logprob_tolerance: float = LOGPROB_TOLERANCE) -> float:
    """The most a policy loss whose terms add up to ``terms_magnitude`` in size may move when
    every token's log-prob moves by up to ``logprob_tolerance`` (pass the gap a test
    measured, `max_logprob_gap`, to check that a loss is the one of those log-probs), plus
    what adding the terms up in fp32 in another order (other micro-batches, ranks) may change."""
    return (math.expm1(logprob_tolerance) + FP32_SUM_ROUNDOFF) * abs(terms_magnitude)


def trained_tokens(rows: Sequence[Sequence[float]], masks: Sequence[Sequence[float]]) -> list[list[float]]:
    """Each row's values at the positions its mask trains on, in order: rows laid out
    differently (a datum's targets, a padded batch's columns) then line up token by token."""
    return [[value for value, m in zip(row, mask, strict=True) if m] for row, mask in zip(rows, masks, strict=True)]


def max_logprob_gap(got: Sequence[Sequence[float]], expected: Sequence[Sequence[float]]) -> float:
    """The largest per-token log-prob difference between two sets of rows of the same tokens."""
    gaps = [abs(a - b) for row_got, row_expected in zip(got, expected, strict=True) for a, b in zip(row_got, row_expected, strict=True)]
    assert gaps, "no token to compare"
    return max(gaps)
