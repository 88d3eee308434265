"""The interfaces that advantage estimators and policy losses implement.

They live in the core so that every place that computes advantages or a loss (the
self-hosted workers, the local Tinker and Weaver services, third-party plugins) speaks
the same types, and the conformance kit can test any implementation against them.
Tensors are torch tensors; torch is only named here for type checkers, never imported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, Union

import attrs

if TYPE_CHECKING:
    import torch

GroupKey = Union[str, int]

ADVANTAGE_INPUTS = frozenset({"group_ids", "run_ids", "old_logprobs", "ref_logprobs", "teacher_logprobs"})
"""Optional `AdvantageInputs` fields an estimator may list in ``requires``."""
TEACHER_LOGPROBS = "teacher_logprobs"
"""The field an estimator lists in ``requires`` to read the recipe's ``teacher``: a
trainer then has the backend score every trajectory under the teacher."""


@attrs.frozen(kw_only=True)
class AdvantageInputs:
    """Everything an advantage estimator may read, for a batch of B rows and T token columns.

    Only ``token_rewards``, ``loss_mask`` and ``valid_rows`` are always present; the rest
    are filled when an estimator lists them in its ``requires``.
    """

    token_rewards: torch.Tensor
    """[B, T] float. The outcome reward sits on the last trained token of each row; a
    KL-in-reward penalty may add per-token terms."""
    loss_mask: torch.Tensor
    """[B, T] float. 1 where a token is trained, 0 on prompts, tool output and padding."""
    valid_rows: torch.Tensor
    """[B] bool. False for rows added by ``Batch.pad_to_world_size``; they must get
    advantage 0 and must not move any statistic."""
    group_ids: Sequence[GroupKey] | None = None
    """B group keys: rows answering the same prompt share one."""
    run_ids: Sequence[GroupKey] | None = None
    """B run keys within a group: an agent run that produced several trajectories
    counts once in group statistics."""
    old_logprobs: torch.Tensor | None = None
    """[B, T] sampler (behaviour policy) logprobs."""
    ref_logprobs: torch.Tensor | None = None
    """[B, T] reference-model logprobs."""
    teacher_logprobs: torch.Tensor | None = None
    """[B, T] the recipe's ``teacher`` model's logprobs of the same tokens (on-policy
    distillation compares them with ``old_logprobs``, the student's)."""


@attrs.frozen(kw_only=True)
class AdvantageOutput:
    """Per-token advantages and returns, zero wherever ``loss_mask`` is zero."""

    advantages: torch.Tensor
    """[B, T] float."""
    returns: torch.Tensor
    """[B, T] float; equal to ``advantages`` for outcome-only estimators."""
    metrics: dict[str, float] = attrs.field(factory=dict)


class AdvantageEstimator(Protocol):
    """Turns rewards into advantages.

    ``requires`` names the optional `AdvantageInputs` fields the estimator reads, so the
    caller can check up front that a batch carries them instead of passing a grab-bag.
    ``group_relative`` says whether the baseline is computed within a group, which makes
    a group whose rewards are all equal get advantage 0.
    """

    requires: frozenset[str]
    group_relative: bool

    def __call__(self, inputs: AdvantageInputs) -> AdvantageOutput: ...


POLICY_LOSS_INPUTS = frozenset({"old_logprobs", "advantages", "entropy", "ref_logprobs"})
"""Optional `PolicyLossInputs` fields a loss may list in ``requires``."""


@attrs.frozen(kw_only=True)
class StepTotals:
    """The divisors of a whole optimizer step, for a loss computed on a part of it.

    A step is often split: into micro-batches that fit in memory, over data-parallel
    ranks, over several requests. A mean over the part ("token-mean", "seq-mean-...")
    would then make the step's gradient a sum of part means, which changes with the
    split. Given the whole step's totals, a loss divides by them instead, so its parts
    add up to the loss of the whole step and the gradient does not depend on the split.
    """

    tokens: float
    """Sum of |loss mask| over the whole step (trained tokens, fractionally weighted; a
    negative weight, which reverses a token's loss, counts by its magnitude)."""
    sequences: float
    """Rows of the step with any trained token (any non-zero weight)."""
    columns: int
    """The step's longest row, in tokens (the default divisor of a per-row token sum)."""

    @classmethod
    def of(cls, loss_mask: torch.Tensor, columns: int | None = None) -> StepTotals:
        """The totals of one [B, T] loss mask; ``columns`` defaults to T."""
        magnitudes = loss_mask.detach().abs()
        return cls(
            tokens=float(magnitudes.sum()),
            sequences=float((magnitudes.sum(dim=-1) > 0).sum()),
            columns=int(loss_mask.shape[-1] if columns is None else columns),
        )

    @classmethod
    def combined(cls, parts: Sequence[StepTotals]) -> StepTotals:
        """The totals of a step made of ``parts`` (micro-batches, ranks)."""
        if not parts:
            raise ValueError("a step needs at least one part to total")
        return cls(
            tokens=sum(part.tokens for part in parts),
            sequences=sum(part.sequences for part in parts),
            columns=max(part.columns for part in parts),
        )


@attrs.frozen(kw_only=True)
class PolicyLossInputs:
    """What a policy loss reads for B rows and T token columns."""

    logprobs: torch.Tensor
    """[B, T] logprobs of the target tokens under the current policy (carries grad)."""
    loss_mask: torch.Tensor
    """[B, T] float weights: 1 for trained tokens, 0 elsewhere (fractional weights allowed)."""
    old_logprobs: torch.Tensor | None = None
    """[B, T] behaviour-policy logprobs (the sampler's, or recomputed)."""
    advantages: torch.Tensor | None = None
    """[B, T] per-token advantages."""
    entropy: torch.Tensor | None = None
    """[B, T] per-token entropy of the current policy, for the entropy bonus."""
    ref_logprobs: torch.Tensor | None = None
    """[B, T] reference-model logprobs, for a KL loss term."""
    step_totals: StepTotals | None = None
    """The whole step's totals when these rows are only part of it (a micro-batch, a
    rank's share). A loss then divides by these instead of the rows' own counts, so
    that the losses of the parts add up to the whole step's loss and their gradients
    to its gradient. None: these rows are the whole step."""


@attrs.frozen(kw_only=True)
class PolicyLossOutput:
    """A scalar loss to call ``backward()`` on and detached float metrics."""

    loss: torch.Tensor
    metrics: dict[str, float] = attrs.field(factory=dict)


class PolicyLoss(Protocol):
    """Computes a scalar loss from per-token logprobs.

    ``requires`` names the optional `PolicyLossInputs` fields it reads; it may depend on
    the loss's config (an entropy bonus needs ``entropy``).
    """

    requires: frozenset[str]

    def __call__(self, inputs: PolicyLossInputs) -> PolicyLossOutput: ...


def check_inputs_present(what: str, name: str, requires: frozenset[str], inputs: object) -> None:
    """Raise a clear error when ``inputs`` lacks a field that ``requires`` lists."""
    missing = sorted(field for field in requires if getattr(inputs, field) is None)
    if missing:
        raise ValueError(
            f"{what} {name!r} needs {', '.join(missing)} but the batch does not carry "
            f"{'it' if len(missing) == 1 else 'them'}; fill {'that field' if len(missing) == 1 else 'those fields'} "
            f"of {type(inputs).__name__} or choose another {what}"
        )
