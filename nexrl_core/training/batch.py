"""`Batch`: trajectories as padded tensors, the unit a self-hosted trainer ships to workers.

Layout. Each trajectory is split at its first trained token into a prompt and a
response. Prompts are left-padded and responses right-padded, so every row's prompt
ends and response starts at the same column ``P`` (``meta["prompt_length"]``): the
layout causal LMs sample in, and the one that lets a worker slice ``[:, P:]`` to get
every response. Whether a column is real or padding is read from ``attention_mask``
only, because a sampled token may legitimately equal the pad id.

This module is the only place in the core that uses torch, and it imports torch inside
the functions that need it, so importing it (or the core) stays cheap.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from nexrl_core.training.algorithms import AdvantageInputs
from nexrl_core.types import Trajectory

if TYPE_CHECKING:
    import torch

TOKEN_ID_TENSORS = ("input_ids", "prompts", "responses")
"""Tensors holding token ids; rows appended as padding fill them with the pad id."""

PADDING_GROUP_PREFIX = "__padding__"
"""Group and run ids of rows appended by `Batch.pad_to_world_size` start with this."""


def _response_start(trajectory: Trajectory) -> int:
    """Index of the first trained token, or the length when nothing is trained."""
    return next((index for index, flag in enumerate(trajectory.loss_mask) if flag == 1), len(trajectory.tokens))


@attrs.frozen
class Batch:
    """Named tensors of B rows, per-row Python values, and batch-wide metadata.

    Tensors made by `from_trajectories` (L = P + R columns):

    - ``input_ids`` [B, L] long: left-padded prompt then right-padded response.
    - ``attention_mask`` [B, L] long: 1 on real tokens, 0 on padding.
    - ``position_ids`` [B, L] long: position of each real token in its row, 0 on padding.
    - ``loss_mask`` [B, L] float: the trajectory's loss mask on real tokens, 0 on padding.
    - ``old_logprobs`` [B, L] float: the sampler's logprobs, 0 on padding.
    - ``prompts`` [B, P] and ``responses`` [B, R] long: the two halves of ``input_ids``.
    - ``rewards`` [B] float and ``valid_rows`` [B] bool (False for rows added as padding).

    Algorithms add more (``advantages``, ``ref_logprobs``); every [B, L] tensor follows
    the same column layout.
    """

    tensors: dict[str, torch.Tensor]
    """Per-row tensors; the first dimension of each is B."""
    non_tensors: dict[str, list[Any]]
    """Per-row Python values (``group_ids``, ``run_ids``, ``task_ids``, ``is_val``), B each."""
    meta: dict[str, Any] = attrs.field(factory=dict)
    """Batch-wide values: ``prompt_length`` (P) and ``pad_token_id``."""

    def __attrs_post_init__(self) -> None:
        rows = {name: tensor.shape[0] for name, tensor in self.tensors.items()}
        rows.update({name: len(values) for name, values in self.non_tensors.items()})
        if len(set(rows.values())) > 1:
            listed = ", ".join(f"{name}={count}" for name, count in rows.items())
            raise ValueError(f"every tensor and non-tensor of a Batch needs the same number of rows, got {listed}")

    def token_values(self, trajectories: Sequence[Trajectory], values: Sequence[Sequence[float]]) -> torch.Tensor:
        """[B, L] float64 of per-token ``values`` (one list per trajectory, aligned with its
        tokens: a holder's reference or teacher logprobs), laid out as
        `from_trajectories` laid out those ``trajectories``' tokens; 0 elsewhere."""
        import torch

        table = torch.zeros(self.tensors["loss_mask"].shape, dtype=torch.float64)
        for row, (trajectory, row_values) in enumerate(zip(trajectories, values, strict=True)):
            if len(row_values) != len(trajectory.tokens):
                raise ValueError(f"row {row}: {len(row_values)} values for {len(trajectory.tokens)} tokens")
            offset = self.prompt_length - _response_start(trajectory)
            table[row, offset : offset + len(trajectory.tokens)] = torch.tensor(row_values, dtype=torch.float64)
        return table

    @classmethod
    def from_trajectories(cls, trajectories: Sequence[Trajectory], pad_token_id: int) -> Batch:
        """Pad ``trajectories`` into one batch (see the class docstring for the layout)."""
        import torch

        if not trajectories:
            raise ValueError("Batch.from_trajectories needs at least one trajectory, got none")
        starts = [_response_start(trajectory) for trajectory in trajectories]
        prompt_length = max(starts)
        response_length = max(len(trajectory.tokens) - start for trajectory, start in zip(trajectories, starts))
        shape = (len(trajectories), prompt_length + response_length)

        input_ids = torch.full(shape, pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros(shape, dtype=torch.long)
        loss_mask = torch.zeros(shape, dtype=torch.float32)
        old_logprobs = torch.zeros(shape, dtype=torch.float32)
        for row, (trajectory, start) in enumerate(zip(trajectories, starts)):
            columns = slice(prompt_length - start, prompt_length - start + len(trajectory.tokens))
            input_ids[row, columns] = torch.tensor(trajectory.tokens, dtype=torch.long)
            attention_mask[row, columns] = 1
            loss_mask[row, columns] = torch.tensor(trajectory.loss_mask, dtype=torch.float32)
            old_logprobs[row, columns] = torch.tensor(trajectory.logprobs, dtype=torch.float32)

        return cls(
            tensors={
                "input_ids": input_ids,
                "attention_mask": attention_mask,
                "position_ids": _position_ids(attention_mask),
                "loss_mask": loss_mask,
                "old_logprobs": old_logprobs,
                "prompts": input_ids[:, :prompt_length].clone(),
                "responses": input_ids[:, prompt_length:].clone(),
                "rewards": torch.tensor([trajectory.reward for trajectory in trajectories], dtype=torch.float32),
                "valid_rows": torch.ones(len(trajectories), dtype=torch.bool),
            },
            non_tensors={
                "group_ids": [trajectory.group_id for trajectory in trajectories],
                "run_ids": [trajectory.run_id for trajectory in trajectories],
                "task_ids": [trajectory.task_id for trajectory in trajectories],
                "is_val": [trajectory.is_val for trajectory in trajectories],
            },
            meta={"prompt_length": prompt_length, "pad_token_id": pad_token_id},
        )

    @property
    def batch_size(self) -> int:
        """B, the number of rows (padding rows included)."""
        return self.tensors["attention_mask"].shape[0]

    def __len__(self) -> int:
        return self.batch_size

    @property
    def prompt_length(self) -> int:
        """P: the column where every response starts."""
        return int(self.meta["prompt_length"])

    def select(self, indices: Sequence[int]) -> Batch:
        """A new batch of the given rows, in the given order (columns unchanged)."""
        import torch

        index = torch.as_tensor(list(indices), dtype=torch.long)
        return Batch(
            tensors={name: tensor[index] for name, tensor in self.tensors.items()},
            non_tensors={name: [values[i] for i in index.tolist()] for name, values in self.non_tensors.items()},
            meta=dict(self.meta),
        )

    def remove_redundant_left_padding(self) -> Batch:
        """Drop the leading prompt columns that are padding in every row.

        Useful after `select`, when the longest prompt of the whole batch is not among
        the chosen rows.
        """
        attended = self._attended_columns()
        unused = min(_count_leading_false(attended), self.prompt_length)
        return self._keep_columns(start=unused, stop=len(attended), prompt_length=self.prompt_length - unused)

    def remove_redundant_right_padding(self) -> Batch:
        """Drop the trailing response columns that are padding in every row."""
        attended = self._attended_columns()
        width = len(attended)
        unused = min(_count_leading_false(attended[::-1]), width - self.prompt_length)
        return self._keep_columns(start=0, stop=width - unused, prompt_length=self.prompt_length)

    def _attended_columns(self) -> list[bool]:
        """Per column: whether any row has a real token there."""
        return self.tensors["attention_mask"].any(dim=0).tolist()

    def _keep_columns(self, start: int, stop: int, prompt_length: int) -> Batch:
        """Slice every [B, L] tensor to columns ``start:stop`` and re-split prompts/responses."""
        width = self.tensors["attention_mask"].shape[1]
        tensors = {
            name: tensor[:, start:stop].clone() if tensor.dim() == 2 and tensor.shape[1] == width else tensor
            for name, tensor in self.tensors.items()
            if name not in ("prompts", "responses")
        }
        tensors["prompts"] = self.tensors["input_ids"][:, start : start + prompt_length].clone()
        tensors["responses"] = self.tensors["input_ids"][:, start + prompt_length : stop].clone()
        return Batch(tensors=tensors, non_tensors=self.non_tensors, meta={**self.meta, "prompt_length": prompt_length})

    def pad_to_world_size(self, world_size: int) -> Batch:
        """Append placeholder rows so that B divides evenly across ``world_size`` ranks.

        The appended rows are not copies of real rows: copies would count twice in
        group statistics (a GRPO group's mean and std) and in the loss. Instead they are
        padding (``valid_rows`` False, loss mask and reward 0, each its own group) with
        exactly one attended column, so attention over them never sees an all-masked
        row, which would give NaN. Returns ``self`` when B already divides.
        """
        import torch

        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        missing = -self.batch_size % world_size
        if missing == 0:
            return self

        attended_column = max(self.prompt_length - 1, 0)
        tensors = {}
        for name, tensor in self.tensors.items():
            padding = torch.zeros((missing, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
            if name in TOKEN_ID_TENSORS:
                padding.fill_(self.meta["pad_token_id"])
            elif name == "attention_mask":
                padding[:, attended_column] = 1
            tensors[name] = torch.cat([tensor, padding])

        new_rows = range(self.batch_size, self.batch_size + missing)
        placeholders: dict[str, list[Any]] = {
            "group_ids": [f"{PADDING_GROUP_PREFIX}{row}" for row in new_rows],
            "run_ids": [f"{PADDING_GROUP_PREFIX}{row}" for row in new_rows],
            "task_ids": [PADDING_GROUP_PREFIX] * missing,
            "is_val": [False] * missing,
        }
        non_tensors = {name: values + placeholders.get(name, [None] * missing) for name, values in self.non_tensors.items()}
        return Batch(tensors=tensors, non_tensors=non_tensors, meta=dict(self.meta))

    def to_advantage_inputs(self) -> AdvantageInputs:
        """What an advantage estimator reads: each row's reward on its last trained token."""
        import torch

        loss_mask = self.tensors["loss_mask"]
        trained = loss_mask > 0
        columns = torch.arange(loss_mask.shape[1], device=loss_mask.device).expand_as(loss_mask)
        last_trained = torch.where(trained, columns, -1).max(dim=1).values
        rows = torch.nonzero(last_trained >= 0).flatten()
        token_rewards = torch.zeros_like(loss_mask)
        token_rewards[rows, last_trained[rows]] = self.tensors["rewards"][rows].to(token_rewards.dtype)
        return AdvantageInputs(
            token_rewards=token_rewards,
            loss_mask=loss_mask,
            valid_rows=self.tensors["valid_rows"],
            group_ids=self.non_tensors["group_ids"],
            run_ids=self.non_tensors["run_ids"],
            old_logprobs=self.tensors.get("old_logprobs"),
            ref_logprobs=self.tensors.get("ref_logprobs"),
            teacher_logprobs=self.tensors.get("teacher_logprobs"),
        )


def _count_leading_false(flags: list[bool]) -> int:
    return next((index for index, flag in enumerate(flags) if flag), len(flags))


def _position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Count real tokens from 0 along each row; padding gets 0."""
    return (attention_mask.cumsum(dim=1) - 1).clamp(min=0) * attention_mask
