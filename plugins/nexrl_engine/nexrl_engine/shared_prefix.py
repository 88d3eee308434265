"""Training forward passes that run a group's shared prompt once.

A GRPO batch holds ``group_size`` datums per prompt: the same prompt tokens followed by
different responses. A plain forward pass runs every prompt ``group_size`` times; on the
quickstart (14-token prompts, 2-8 token answers, groups of 8) that is two thirds of the
work. Here the rows that share a prefix form a group; the prefix goes through the model
once per group (with gradients), its key/value cache is indexed out to the group's rows,
and only each row's own suffix goes through the model again, attending to that cache.
The gradient of the prefix is the sum over its rows, exactly as with separate rows, so
logprobs and gradients equal the plain pass up to float rounding.

`plan_prefix_sharing` finds the groups and says whether sharing pays off;
`shared_prefix_logprobs` returns the same [B, T] target logprobs (and entropies) as
`nexrl_engine.loss_fns.target_logprobs`, so the losses never know the difference;
`chunk_logprobs` picks between the two for a collated chunk, and is what the engine and
the workers call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from nexrl_engine.loss_fns import CheckedDatum, PaddedBatch, at_least_float32, target_logprobs
from nexrl_engine.sampling import positions_from_mask

__all__ = ["PrefixPlan", "chunk_logprobs", "plan_prefix_sharing", "shared_prefix_logprobs"]

MIN_SHARED_TOKENS = 2
"""Rows join a group only if they share at least this many leading tokens."""
MAX_COST_RATIO = 0.8
"""Share only when the two passes process at most this fraction of the plain pass's
padded tokens (attention over the cache is cheap next to the matmuls it saves)."""


@attrs.frozen
class PrefixPlan:
    """Which rows share which prefix: ``group_of_row[b]`` is row b's group, whose first
    ``prefix_lengths[g]`` tokens go through the model once."""

    group_of_row: list[int]
    prefix_lengths: list[int]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length


def plan_prefix_sharing(inputs: Sequence[Sequence[int]]) -> PrefixPlan | None:
    """Group rows by shared leading tokens; None when sharing would not save work.

    Rows are sorted so that equal prompts sit together; a row joins the current group
    when it shares at least half of the group's prefix so far (and at least
    `MIN_SHARED_TOKENS`), so a common chat-template header alone does not merge two
    different prompts. A group's prefix leaves every member at least one token of its
    own, and is at least one token long.
    """
    order = sorted(range(len(inputs)), key=lambda row: list(inputs[row]))
    members: list[list[int]] = []
    shared: list[int] = []
    for row in order:
        if members:
            head = inputs[members[-1][0]]
            common = min(_common_prefix(head, inputs[row]), shared[-1])
            if common >= max(MIN_SHARED_TOKENS, shared[-1] // 2):
                members[-1].append(row)
                shared[-1] = common
                continue
        members.append([row])
        shared.append(len(inputs[row]))
    if all(len(group) == 1 for group in members):
        return None
    group_of_row = [0] * len(inputs)
    prefix_lengths = []
    for group, rows in enumerate(members):
        for row in rows:
            group_of_row[row] = group
        shortest = min(len(inputs[row]) for row in rows)
        prefix_lengths.append(max(1, min(shared[group], shortest - 1)))
    longest_prefix = max(prefix_lengths)
    longest_suffix = max(len(inputs[row]) - prefix_lengths[group_of_row[row]] for row in range(len(inputs)))
    shared_cost = len(members) * longest_prefix + len(inputs) * longest_suffix
    plain_cost = len(inputs) * max(len(row) for row in inputs)
    if shared_cost > MAX_COST_RATIO * plain_cost:
        return None
    return PrefixPlan(group_of_row, prefix_lengths)


def _target_logprobs_and_entropy(
    logits: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor, targets: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) of every [B, W] position, read at ``logits[rows, columns]``, and the
    entropy there if asked. The softmax runs once per pass position, not once per row."""
    log_p = torch.log_softmax(at_least_float32(logits), dim=-1)
    logprobs = log_p[rows, columns, targets]
    entropy = None
    if with_entropy:
        entropy = -(log_p.exp() * log_p).sum(dim=-1)[rows, columns]
    return logprobs, entropy


def shared_prefix_logprobs(
    model: Any, batch: PaddedBatch, plan: PrefixPlan, pad_id: int, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, T] log p(target | prefix) as `target_logprobs` computes it (graph kept when
    grad is enabled; 0 on padding), with each group's prefix run once."""
    device = batch.input_ids.device
    rows, width = batch.input_ids.shape
    lengths = torch.tensor(batch.lengths, device=device)
    group_of_row = torch.tensor(plan.group_of_row, device=device)
    prefix_lengths = torch.tensor(plan.prefix_lengths, device=device)
    row_prefix = prefix_lengths[group_of_row]  # [B]
    groups, prefix_width = len(plan.prefix_lengths), int(max(plan.prefix_lengths))
    suffix_width = int((lengths - row_prefix).max().clamp(min=1))

    # Prefix pass: one left-padded row per group (taken from its first member).
    first_row = [plan.group_of_row.index(group) for group in range(groups)]
    prefix_ids = torch.full((groups, prefix_width), pad_id, dtype=torch.long, device=device)
    prefix_mask = torch.zeros((groups, prefix_width), dtype=torch.long, device=device)
    for group, row in enumerate(first_row):
        length = plan.prefix_lengths[group]
        prefix_ids[group, prefix_width - length :] = batch.input_ids[row, :length]
        prefix_mask[group, prefix_width - length :] = 1
    prefix_out = model(
        input_ids=prefix_ids,
        attention_mask=prefix_mask,
        position_ids=positions_from_mask(prefix_mask),
        use_cache=True,
    )
    cache = prefix_out.past_key_values
    cache.batch_select_indices(group_of_row)

    # Suffix pass: every row's own tokens, right-padded, attending to its group's cache.
    steps = torch.arange(suffix_width, device=device)[None, :]
    suffix_columns = (row_prefix[:, None] + steps).clamp(max=width - 1)
    suffix_valid = row_prefix[:, None] + steps < lengths[:, None]
    suffix_ids = torch.where(suffix_valid, batch.input_ids.gather(1, suffix_columns), pad_id)
    suffix_out = model(
        input_ids=suffix_ids,
        attention_mask=torch.cat([prefix_mask[group_of_row], suffix_valid.long()], dim=1),
        position_ids=row_prefix[:, None] + steps,
        past_key_values=cache,
        use_cache=True,
    )

    # Target position t of row b: the prefix pass's column (prefix_width - L + t) while
    # t < L, the suffix pass's column (t - L) after that.
    positions = torch.arange(width, device=device)[None, :].expand(rows, width)
    in_prefix = positions < row_prefix[:, None]
    prefix_logprobs, prefix_entropy = _target_logprobs_and_entropy(
        prefix_out.logits,
        group_of_row[:, None].expand(rows, width),
        (prefix_width - row_prefix[:, None] + positions).clamp(0, prefix_width - 1),
        batch.targets,
        with_entropy,
    )
    suffix_logprobs, suffix_entropy = _target_logprobs_and_entropy(
        suffix_out.logits,
        torch.arange(rows, device=device)[:, None].expand(rows, width),
        (positions - row_prefix[:, None]).clamp(0, suffix_width - 1),
        batch.targets,
        with_entropy,
    )
    real = positions < lengths[:, None]
    zero = torch.zeros((), device=device)
    logprobs = torch.where(real, torch.where(in_prefix, prefix_logprobs, suffix_logprobs), zero)
    entropy = None
    if with_entropy:
        assert prefix_entropy is not None and suffix_entropy is not None
        entropy = torch.where(real, torch.where(in_prefix, prefix_entropy, suffix_entropy), zero)
    return logprobs, entropy


def chunk_logprobs(
    model: Any, chunk: Sequence[CheckedDatum], batch: PaddedBatch, pad_id: int, with_entropy: bool = False, share: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, T] target logprobs (and entropies) of ``chunk`` collated as ``batch``, running
    a prefix its rows share once when ``share`` and the plan says it saves work."""
    plan = plan_prefix_sharing([datum.input_tokens for datum in chunk]) if share else None
    if plan is None:
        return target_logprobs(model, batch, with_entropy=with_entropy)
    return shared_prefix_logprobs(model, batch, plan, pad_id, with_entropy=with_entropy)
