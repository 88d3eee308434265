"""A batch's rows as the engine's datums, and the checks a batch passes before any rank sees it.

The workers reuse the engine's loss path (`nexrl_engine.loss_fns`: collate, target
logprobs, the registered losses): each row of a `nexrl_core.training.batch.Batch` layout (prompt
left-padded, response right-padded, real tokens contiguous) becomes one datum whose
input is its real tokens but the last and whose targets are its real tokens but the
first; a per-token value of the batch (old logprobs, advantages, the loss mask) at the
column of token t belongs to the datum position that predicts t. A row with fewer than
two real tokens (a row `Batch.pad_to_world_size` appended) becomes a one-token datum of
weight 0, so every rank runs the same passes and padding moves nothing.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from nexrl_engine.loss_fns import CheckedDatum
from nexrl_fsdp.direct_zmq.protocol import BATCH_TENSORS, OPTIONAL_BATCH_TENSORS

__all__ = ["BatchError", "check_batch", "row_datums", "scatter_back"]

_DATUM_KEYS = {"loss_mask": "mask", "old_logprobs": "logprobs", "advantages": "advantages", "ref_logprobs": "ref_logprobs"}
"""Batch tensor → `loss_fns` datum key."""


class BatchError(ValueError):
    """A batch the workers refuse; the message names the tensor and what to fix."""


def check_batch(tensors: Mapping[str, torch.Tensor], needed: set[str], world_size: int, vocab_size: int | None) -> None:
    """Refuse a batch with a missing tensor, a wrong dtype, mismatched shapes, a row
    count that does not divide over the ranks, or token ids outside the vocabulary."""
    missing = sorted((set(BATCH_TENSORS) | needed) - set(tensors))
    if missing:
        raise BatchError(f"the batch lacks tensors {missing}; it has {sorted(tensors)}")
    allowed = {**BATCH_TENSORS, **OPTIONAL_BATCH_TENSORS}
    shape = tuple(tensors["input_ids"].shape)
    if len(shape) != 2 or shape[0] == 0 or shape[1] == 0:
        raise BatchError(f"input_ids must be a non-empty [B, L] tensor, got shape {list(shape)}")
    for name, tensor in tensors.items():
        if name not in allowed:
            continue
        if str(tensor.dtype).removeprefix("torch.") != allowed[name]:
            raise BatchError(f"tensor {name!r} has dtype {str(tensor.dtype).removeprefix('torch.')}; it must be {allowed[name]}")
        if tuple(tensor.shape) != shape:
            raise BatchError(
                f"tensor {name!r} has shape {list(tensor.shape)} but input_ids has {list(shape)}; every [B, L] tensor must match"
            )
    if shape[0] % world_size:
        raise BatchError(f"the batch has {shape[0]} rows, which do not divide over {world_size} ranks; pad it with Batch.pad_to_world_size")
    if vocab_size is not None:
        ids = tensors["input_ids"][tensors["attention_mask"].bool()]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise BatchError(f"input_ids has token ids outside the vocabulary [0, {vocab_size})")


def row_datums(tensors: Mapping[str, torch.Tensor], pad_id: int) -> tuple[list[CheckedDatum], list[torch.Tensor]]:
    """One datum per row, and per row the columns its targets sit in."""
    datums, columns = [], []
    real_rows = tensors["attention_mask"].bool()
    present = [key for name, key in _DATUM_KEYS.items() if name in tensors]
    for row in range(real_rows.shape[0]):
        cols = torch.nonzero(real_rows[row]).flatten()
        if cols.numel() < 2:
            # Every key the real rows carry, so a chunk of only such rows collates the same way.
            datums.append(CheckedDatum([pad_id], {"target_tokens": [pad_id], **{key: [0.0] for key in present}, "mask": [0.0]}))
            columns.append(cols[:0])
            continue
        tokens = tensors["input_ids"][row, cols].tolist()
        values: dict[str, list] = {"target_tokens": tokens[1:]}
        for name, key in _DATUM_KEYS.items():
            if name in tensors:
                values[key] = tensors[name][row, cols[1:]].tolist()
        if "mask" not in values:
            values["mask"] = [1.0] * (len(tokens) - 1)
        datums.append(CheckedDatum(tokens[:-1], values))
        columns.append(cols[1:])
    return datums, columns


def scatter_back(values: list[torch.Tensor], columns: list[torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
    """[B, L] float32 with each row's per-target values at its target columns, 0 elsewhere."""
    out = torch.zeros(shape, dtype=torch.float32)
    for row, (row_values, cols) in enumerate(zip(values, columns)):
        if cols.numel():
            out[row, cols] = row_values[: cols.numel()].to(torch.float32)
    return out
