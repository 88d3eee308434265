"""One rank's micro-batches, as many on every rank.

FSDP2 all-gathers each unit's parameters inside every forward (and reduce-scatters its
gradients in every backward), so every rank must run the same number of passes or the
collectives of one rank's extra pass wait for partners that never come. Packing by a
token budget gives ranks holding rows of different lengths different numbers of
micro-batches; the ranks agree on the most any of them needs, and one with fewer runs
idle passes: a one-token datum of weight 0, which adds nothing to the loss, the
gradients or the metrics.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs
import torch
import torch.distributed as dist

from nexrl_engine.loss_fns import CheckedDatum, split_microbatches

__all__ = ["Pass", "aligned_passes", "idle_datum"]


@attrs.frozen
class Pass:
    """The datums of one forward (or forward and backward) on this rank."""

    datums: list[CheckedDatum]
    idle: bool = False
    """Run only so that the collectives meet; its results are dropped."""


def idle_datum(pad_id: int, keys: Iterable[str]) -> CheckedDatum:
    """A one-token datum of weight 0 carrying ``keys`` (those of the real datums, so that
    every pass collates the same tensors)."""
    values: dict[str, list] = {key: [0.0] for key in keys}
    values["mask"] = [0.0]
    values["target_tokens"] = [pad_id]
    return CheckedDatum([pad_id], values)


def aligned_passes(
    datums: Sequence[CheckedDatum], *, max_tokens: int | None, max_rows: int | None, pad_id: int, keys: Iterable[str] | None = None
) -> list[Pass]:
    """This rank's ``datums`` in consecutive micro-batches of at most ``max_tokens``
    padded tokens and ``max_rows`` rows (either None: no such limit), then idle passes
    up to the most any rank runs (one all-reduce). ``keys``: what an idle datum carries;
    by default every key of ``datums``."""
    groups = split_microbatches(datums, max_tokens, max_rows) if datums else []
    most = torch.tensor([len(groups)], dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
    passes = [Pass([datums[index] for index in group]) for group in groups]
    if int(most[0]) > len(passes):
        carried = set(keys) if keys is not None else {key for datum in datums for key in datum.values}
        idle = Pass([idle_datum(pad_id, carried - {"target_tokens"})], idle=True)
        passes.extend([idle] * (int(most[0]) - len(passes)))
    return passes
