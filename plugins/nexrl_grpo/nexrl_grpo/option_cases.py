"""For each option of each loss this plugin registers, two values that give different
gradients on `nexrl_core.testing.LossOptionContract`'s probe datums.

Backends import the table into their tests to show every option reaches the loss that
makes the gradient (or is refused), so adding an option here without a case fails the
contract's coverage check.
"""

from __future__ import annotations

from nexrl_core.testing.loss_option_contract import LossOptionCase

__all__ = ["LOSS_OPTION_CASES"]

_SEQUENCE_NORM = {"agg_mode": "seq-mean-token-sum-norm"}
"""The only aggregation that reads ``norm_constant``."""

LOSS_OPTION_CASES: tuple[LossOptionCase, ...] = (
    LossOptionCase("cross_entropy", "agg_mode", "token-sum", "token-mean"),
    LossOptionCase("cross_entropy", "norm_constant", 1.0, 4.0, _SEQUENCE_NORM),
    LossOptionCase("importance_sampling", "agg_mode", "token-sum", "seq-mean-token-mean"),
    LossOptionCase("importance_sampling", "norm_constant", 1.0, 4.0, _SEQUENCE_NORM),
    LossOptionCase("importance_sampling", "entropy_coeff", 0.0, 0.5),
    LossOptionCase("ppo", "clip_low", 0.2, 0.6),
    LossOptionCase("ppo", "clip_high", 0.2, 1.0),
    LossOptionCase("ppo", "dual_clip_c", 3.0, 10.0),
    LossOptionCase("ppo", "agg_mode", "token-sum", "token-mean"),
    LossOptionCase("ppo", "norm_constant", 1.0, 4.0, _SEQUENCE_NORM),
    LossOptionCase("ppo", "entropy_coeff", 0.0, 0.5),
    LossOptionCase("cispo", "clip_low", 0.2, 0.6),
    LossOptionCase("cispo", "clip_high", 0.2, 1.0),
    LossOptionCase("cispo", "agg_mode", "token-sum", "token-mean"),
    LossOptionCase("cispo", "norm_constant", 1.0, 4.0, _SEQUENCE_NORM),
    LossOptionCase("cispo", "entropy_coeff", 0.0, 0.5),
    LossOptionCase("gspo", "clip_low", 3e-4, 0.5),
    LossOptionCase("gspo", "clip_high", 4e-4, 1.0),
    LossOptionCase("gspo", "agg_mode", "token-sum", "seq-mean-token-mean"),
    LossOptionCase("gspo", "norm_constant", 1.0, 4.0, _SEQUENCE_NORM),
    LossOptionCase("gspo", "entropy_coeff", 0.0, 0.5),
    LossOptionCase("dro", "beta", 0.05, 2.0),
    LossOptionCase("dro", "agg_mode", "token-sum", "token-mean"),
    LossOptionCase("dro", "norm_constant", 1.0, 4.0, _SEQUENCE_NORM),
)
