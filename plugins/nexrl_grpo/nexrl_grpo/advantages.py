"""Advantage estimators: GRPO, Dr. GRPO, RLOO and REINFORCE++.

The group-relative estimators score each row by its summed reward, compare it with the
other answers to the same prompt and broadcast one advantage over the row's trained
tokens. An agent run that produced several trajectories is averaged first, so it counts
once in its group however many rows it has.

Group statistics are computed in float64 on the CPU (they are [B]-sized) and every sum
adds its terms in ascending order of value, so the result does not depend on the order
of rows in the batch, bit for bit: shuffling a batch permutes its advantages and nothing
else.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import attrs
import torch

from nexrl_core.training.algorithms import AdvantageInputs, AdvantageOutput, GroupKey, check_inputs_present
from nexrl_grpo.config import DrGrpoConfig, GrpoConfig, ReinforcePlusPlusConfig, RlooConfig

__all__ = [
    "DrGrpoEstimator",
    "GrpoEstimator",
    "ReinforcePlusPlusEstimator",
    "RlooEstimator",
    "discounted_returns",
]

_WHAT = "advantage estimator"
_SHOWN_ROWS = 10


# --- input checks ----------------------------------------------------------------------------


def _row_list(rows: torch.Tensor) -> str:
    """Render offending row indices, shortened so a huge batch gives a readable error."""
    indices = rows.tolist()
    shown = ", ".join(str(i) for i in indices[:_SHOWN_ROWS])
    more = f" and {len(indices) - _SHOWN_ROWS} more" if len(indices) > _SHOWN_ROWS else ""
    return f"[{shown}]{more}"


def _check(name: str, requires: frozenset[str], inputs: AdvantageInputs) -> torch.Tensor:
    """Check presence, shapes and finiteness; return the rows that count as a CPU bool tensor.

    A row counts when it is valid and has at least one trained token: a row without any
    has no score (scores are read through the mask), so letting it in would pull its
    group's baseline towards a made-up 0.
    """
    check_inputs_present(_WHAT, name, requires, inputs)
    rewards, mask, valid = inputs.token_rewards, inputs.loss_mask, inputs.valid_rows
    if rewards.dim() != 2:
        raise ValueError(f"{_WHAT} {name!r}: token_rewards must be [B, T], got shape {tuple(rewards.shape)}")
    batch = rewards.shape[0]
    if mask.shape != rewards.shape:
        raise ValueError(f"{_WHAT} {name!r}: loss_mask must have token_rewards' shape {tuple(rewards.shape)}, got {tuple(mask.shape)}")
    if valid.shape != (batch,):
        raise ValueError(f"{_WHAT} {name!r}: valid_rows must be [B] = [{batch}], got shape {tuple(valid.shape)}")
    for field in ("group_ids", "run_ids"):
        ids = getattr(inputs, field)
        if field in requires and len(ids) != batch:
            raise ValueError(f"{_WHAT} {name!r}: {field} has {len(ids)} entries for a batch of {batch} rows")
    valid = valid.detach().to("cpu", torch.bool)
    for field, tensor in (("token_rewards", rewards), ("loss_mask", mask)):
        bad_rows = torch.nonzero(valid & ~torch.isfinite(tensor.detach()).all(dim=-1).cpu()).flatten()
        if bad_rows.numel():
            raise ValueError(f"{_WHAT} {name!r}: {field} has NaN or inf values in valid rows {_row_list(bad_rows)}")
    return valid & (mask.detach() != 0).any(dim=-1).cpu()


def _trained(inputs: AdvantageInputs, counted: torch.Tensor) -> torch.Tensor:
    """[B, T] bool on the inputs' device: trained tokens of the rows in ``counted``."""
    return (inputs.loss_mask != 0) & counted.to(inputs.loss_mask.device)[:, None]


def _masked_rewards(inputs: AdvantageInputs, trained: torch.Tensor) -> torch.Tensor:
    """token_rewards * loss_mask in float64, exactly 0 off ``trained`` (even where padding rows hold NaN)."""
    rewards = inputs.token_rewards.detach().to(torch.float64)
    weighted = rewards * inputs.loss_mask.detach().to(torch.float64)
    return torch.where(trained, weighted, torch.zeros_like(weighted))


def _output_dtype(inputs: AdvantageInputs) -> torch.dtype:
    dtype = inputs.token_rewards.dtype
    return dtype if dtype.is_floating_point else torch.float32


def _sorted_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum in ascending order, so the result is the same for any order of ``values``."""
    return torch.sort(values).values.sum()


def _token_metrics(advantages: torch.Tensor, trained: torch.Tensor) -> dict[str, float]:
    """Mean and (population) std of the advantages over trained tokens; 0 when there are none."""
    values = advantages[trained].detach().to("cpu", torch.float64)
    if values.numel() == 0:
        return {"advantages/mean": 0.0, "advantages/std": 0.0}
    mean = _sorted_sum(values) / values.numel()
    std = torch.sqrt(_sorted_sum((values - mean).square()) / values.numel())
    return {"advantages/mean": float(mean), "advantages/std": float(std)}


# --- grouping ----------------------------------------------------------------------------------


def _keys(ids: Sequence[GroupKey]) -> list[GroupKey]:
    """Plain Python keys: elements of a tensor hash by identity, so convert them first."""
    to_list = getattr(ids, "tolist", None)
    return to_list() if callable(to_list) else list(ids)


def _segment_sum(values: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """Sum ``values`` into ``size`` bins, adding each bin's terms in ascending order of value."""
    order = torch.sort(values, stable=True).indices
    return torch.zeros(size, dtype=values.dtype).index_add_(0, index[order], values[order])


def _segment_extreme(values: torch.Tensor, index: torch.Tensor, size: int, reduce: str) -> torch.Tensor:
    return torch.zeros(size, dtype=values.dtype).scatter_reduce_(0, index, values, reduce, include_self=False)


@attrs.frozen(kw_only=True)
class _GroupStats:
    """Per-group statistics of the counted rows, with the maps back to rows.

    Indices are over the counted rows only (``rows`` holds their batch positions), runs are
    keyed by (group, run) so equal run ids in different groups never merge.
    """

    rows: torch.Tensor
    """[V] batch index of each counted row."""
    scores: torch.Tensor
    """[V] float64 score of each counted row."""
    group_of_row: torch.Tensor
    """[V] group index of each counted row."""
    run_of_row: torch.Tensor
    """[V] run index of each counted row."""
    run_means: torch.Tensor
    """[R] mean score of each run's rows."""
    group_of_run: torch.Tensor
    """[R] group index of each run."""
    runs_per_group: torch.Tensor
    """[G] number of distinct runs in each group."""
    run_mean_sums: torch.Tensor
    """[G] sum of the group's run means."""
    degenerate: torch.Tensor
    """[G] bool: fewer than 2 runs, or nothing to tell the answers apart; advantage 0."""

    @property
    def baselines(self) -> torch.Tensor:
        """[G] mean of the group's run means."""
        return self.run_mean_sums / self.runs_per_group

    def run_std(self) -> torch.Tensor:
        """[G] unbiased std of the run means (0 for groups with fewer than 2 runs)."""
        deviations = (self.run_means - self.baselines[self.group_of_run]).square()
        sums = _segment_sum(deviations, self.group_of_run, self.runs_per_group.numel())
        return torch.sqrt(sums / (self.runs_per_group - 1).clamp_min(1))


def _group_stats(scores: torch.Tensor, counted: torch.Tensor, inputs: AdvantageInputs) -> _GroupStats:
    """Index groups and runs of the counted rows and reduce ``scores`` [B] (float64, CPU) over them."""
    rows = torch.nonzero(counted).flatten()
    # Every caller requires both (`_check` refused inputs without them).
    assert inputs.group_ids is not None and inputs.run_ids is not None
    group_keys, run_keys = _keys(inputs.group_ids), _keys(inputs.run_ids)
    group_index: dict[GroupKey, int] = {}
    run_index: dict[tuple[GroupKey, GroupKey], int] = {}
    group_of_run: list[int] = []
    run_of_row: list[int] = []
    for row in rows.tolist():
        group = group_index.setdefault(group_keys[row], len(group_index))
        run_key = (group_keys[row], run_keys[row])
        if run_key not in run_index:
            run_index[run_key] = len(run_index)
            group_of_run.append(group)
        run_of_row.append(run_index[run_key])

    n_groups, n_runs = len(group_index), len(run_index)
    run_of_row_t = torch.tensor(run_of_row, dtype=torch.long)
    group_of_run_t = torch.tensor(group_of_run, dtype=torch.long)
    group_of_row_t = group_of_run_t[run_of_row_t]
    row_scores = scores[rows]

    run_sizes = torch.bincount(run_of_row_t, minlength=n_runs).to(torch.float64)
    run_means = _segment_sum(row_scores, run_of_row_t, n_runs) / run_sizes
    runs_per_group = torch.bincount(group_of_run_t, minlength=n_groups).to(torch.float64)

    def spread_is_zero(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        highest = _segment_extreme(values, index, n_groups, "amax")
        return highest == _segment_extreme(values, index, n_groups, "amin")

    # Identical row scores are checked as well as identical run means: averaging equal
    # scores over runs of different sizes can round them apart by one ulp.
    degenerate = (runs_per_group < 2) | spread_is_zero(row_scores, group_of_row_t) | spread_is_zero(run_means, group_of_run_t)
    return _GroupStats(
        rows=rows,
        scores=row_scores,
        group_of_row=group_of_row_t,
        run_of_row=run_of_row_t,
        run_means=run_means,
        group_of_run=group_of_run_t,
        runs_per_group=runs_per_group,
        run_mean_sums=_segment_sum(run_means, group_of_run_t, n_groups),
        degenerate=degenerate,
    )


def _outcome_output(
    inputs: AdvantageInputs,
    counted: torch.Tensor,
    stats: _GroupStats,
    row_advantages: torch.Tensor,
) -> AdvantageOutput:
    """Zero degenerate groups, scatter [V] advantages to [B], broadcast over trained tokens."""
    row_advantages = torch.where(stats.degenerate[stats.group_of_row], 0.0, row_advantages)
    per_row = torch.zeros(counted.shape[0], dtype=torch.float64).index_copy_(0, stats.rows, row_advantages)
    trained = _trained(inputs, counted)
    per_row = per_row.to(device=trained.device, dtype=_output_dtype(inputs))
    advantages = torch.where(trained, per_row[:, None], torch.zeros((), dtype=per_row.dtype, device=trained.device))
    score_mean = _sorted_sum(stats.scores) / stats.scores.numel() if stats.scores.numel() else torch.tensor(0.0)
    metrics = {
        **_token_metrics(advantages, trained),
        "score/mean": float(score_mean),
        "groups/count": float(stats.runs_per_group.numel()),
        "groups/degenerate": float(stats.degenerate.sum()),
    }
    return AdvantageOutput(advantages=advantages, returns=advantages, metrics=metrics)


def _group_relative(name: str, requires: frozenset[str], inputs: AdvantageInputs) -> tuple[torch.Tensor, _GroupStats]:
    counted = _check(name, requires, inputs)
    scores = _masked_rewards(inputs, _trained(inputs, counted)).sum(dim=-1).cpu()
    return counted, _group_stats(scores, counted, inputs)


def discounted_returns(rewards: torch.Tensor, trained: torch.Tensor, gamma: float) -> torch.Tensor:
    """[B, T] return-to-go of ``rewards`` (already 0 off ``trained``), 0 off ``trained``.

    Each trained token's return is its reward plus ``gamma`` times the next trained
    token's return: a step is a trained token, so tool output between two turns is
    neither discounted nor rewarded.
    """
    if gamma == 1.0:
        returns = rewards.flip(-1).cumsum(-1).flip(-1)
    else:
        returns = torch.zeros_like(rewards)
        running = torch.zeros_like(rewards[:, 0])
        for t in range(rewards.shape[1] - 1, -1, -1):
            running = torch.where(trained[:, t], rewards[:, t] + gamma * running, running)
            returns[:, t] = running
    return torch.where(trained, returns, torch.zeros_like(returns))


# --- estimators ----------------------------------------------------------------------------------


class GrpoEstimator:
    """GRPO: A = (score - mean of the group's run means) / (std of the run means + eps).

    With ``norm_by_std`` false the division is skipped.
    """

    name: ClassVar[str] = "grpo"
    requires: ClassVar[frozenset[str]] = frozenset({"group_ids", "run_ids"})
    group_relative: ClassVar[bool] = True

    def __init__(self, config: GrpoConfig) -> None:
        self.config = config

    def __call__(self, inputs: AdvantageInputs) -> AdvantageOutput:
        counted, stats = _group_relative(self.name, self.requires, inputs)
        advantages = stats.scores - stats.baselines[stats.group_of_row]
        if self.config.norm_by_std:
            advantages = advantages / (stats.run_std() + self.config.eps)[stats.group_of_row]
        return _outcome_output(inputs, counted, stats, advantages)


class DrGrpoEstimator:
    """Dr. GRPO: A = score - mean of the group's run means (no std division)."""

    name: ClassVar[str] = "dr_grpo"
    requires: ClassVar[frozenset[str]] = frozenset({"group_ids", "run_ids"})
    group_relative: ClassVar[bool] = True

    def __init__(self, config: DrGrpoConfig) -> None:
        self.config = config

    def __call__(self, inputs: AdvantageInputs) -> AdvantageOutput:
        counted, stats = _group_relative(self.name, self.requires, inputs)
        return _outcome_output(inputs, counted, stats, stats.scores - stats.baselines[stats.group_of_row])


class RlooEstimator:
    """RLOO: A = score - mean of the other runs' means in the group (leave one run out)."""

    name: ClassVar[str] = "rloo"
    requires: ClassVar[frozenset[str]] = frozenset({"group_ids", "run_ids"})
    group_relative: ClassVar[bool] = True

    def __init__(self, config: RlooConfig) -> None:
        self.config = config

    def __call__(self, inputs: AdvantageInputs) -> AdvantageOutput:
        counted, stats = _group_relative(self.name, self.requires, inputs)
        group, run = stats.group_of_row, stats.run_of_row
        others = (stats.runs_per_group[group] - 1).clamp_min(1)
        baselines = (stats.run_mean_sums[group] - stats.run_means[run]) / others
        return _outcome_output(inputs, counted, stats, stats.scores - baselines)


class ReinforcePlusPlusEstimator:
    """REINFORCE++: per-token discounted return-to-go, whitened over the batch.

    Discounting counts trained tokens only: a span of tool output between two turns is
    neither discounted nor rewarded. The whitening mean and (population) std run over
    every trained token of the valid rows, so no prompt grouping is needed.
    """

    name: ClassVar[str] = "reinforce_plus_plus"
    requires: ClassVar[frozenset[str]] = frozenset()
    group_relative: ClassVar[bool] = False

    def __init__(self, config: ReinforcePlusPlusConfig) -> None:
        self.config = config

    def __call__(self, inputs: AdvantageInputs) -> AdvantageOutput:
        counted = _check(self.name, self.requires, inputs)
        trained = _trained(inputs, counted)
        rewards = _masked_rewards(inputs, trained)
        returns = discounted_returns(rewards, trained, self.config.gamma)

        values = returns[trained]
        count = max(values.numel(), 1)
        mean = _sorted_sum(values) / count
        std = torch.sqrt(_sorted_sum((values - mean).square()) / count)
        whitened = torch.where(trained, (returns - mean) / (std + self.config.eps), torch.zeros_like(returns))

        dtype = _output_dtype(inputs)
        advantages, returns = whitened.to(dtype), returns.to(dtype)
        n_counted = int(counted.sum())
        scores = rewards.sum(dim=-1)[counted.to(rewards.device)]
        metrics = {
            **_token_metrics(advantages, trained),
            "returns/mean": float(mean),
            "score/mean": float(_sorted_sum(scores) / n_counted) if n_counted else 0.0,
        }
        return AdvantageOutput(advantages=advantages, returns=returns, metrics=metrics)
