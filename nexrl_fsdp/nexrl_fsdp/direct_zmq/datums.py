"""Tinker-shaped datums as raw tensor frames, for the workers' datum ops (``forward``).

A request's datums have different lengths and not all carry the same ``loss_fn_inputs``
keys, so they travel as ragged columns, each one flat tensor over every datum:

* ``input_tokens`` (int64): every datum's tokens, one after the other;
* ``lengths`` (int64, one per datum): where each datum's tokens end;
* per key ``k`` of `loss_fn.DATUM_KEYS` that any datum has: ``value:k`` (int64 for
  ``target_tokens``, float32 otherwise) with the values of the datums that have it, and
  ``has:k`` (uint8, one per datum) saying which those are.

Nothing is pickled (see `wire`), and the receiver checks the datums again with
`loss_fns.check_datums` before any rank sees them.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import torch

from nexrl_engine.loss_fns import DATUM_KEYS, CheckedDatum
from nexrl_engine.types import Datum

__all__ = ["datum_tensors", "tensor_datums"]

_LENGTHS = "lengths"
_TOKENS = "input_tokens"
_INTEGER_KEYS = frozenset({"target_tokens"})


def datum_tensors(datums: Sequence[CheckedDatum]) -> dict[str, torch.Tensor]:
    """The flat tensors of checked datums (see the module docstring)."""
    tensors = {
        _LENGTHS: torch.tensor([len(datum.input_tokens) for datum in datums], dtype=torch.int64),
        _TOKENS: torch.tensor([token for datum in datums for token in datum.input_tokens], dtype=torch.int64),
    }
    for key in DATUM_KEYS:
        has = [key in datum.values for datum in datums]
        if not any(has):
            continue
        dtype = torch.int64 if key in _INTEGER_KEYS else torch.float32
        values = [float(value) for datum in datums if key in datum.values for value in datum.values[key]]
        tensors[f"has:{key}"] = torch.tensor(has, dtype=torch.uint8)
        tensors[f"value:{key}"] = torch.tensor(values, dtype=torch.float64).to(dtype)
    return tensors


def tensor_datums(tensors: Mapping[str, torch.Tensor]) -> list[Datum]:
    """The datums `datum_tensors` encoded, as `Datum` records for `check_datums`.

    :raises ValueError: naming the tensor whose size does not fit the lengths.
    """
    for name in (_LENGTHS, _TOKENS):
        if name not in tensors:
            raise ValueError(f"the datums lack the {name!r} tensor; they have {sorted(tensors)}")
    lengths = [int(n) for n in tensors[_LENGTHS].tolist()]
    if any(n < 1 for n in lengths):
        raise ValueError("every datum needs at least one input token")
    tokens = tensors[_TOKENS].tolist()
    if len(tokens) != sum(lengths):
        raise ValueError(f"input_tokens holds {len(tokens)} tokens but the lengths add up to {sum(lengths)}")
    starts = [0, *itertools.accumulate(lengths)][:-1]
    inputs: list[dict[str, list]] = [{} for _ in lengths]
    for name, tensor in tensors.items():
        if not name.startswith("has:"):
            continue
        key = name.removeprefix("has:")
        if key not in DATUM_KEYS or f"value:{key}" not in tensors:
            raise ValueError(f"unknown or incomplete datum column {name!r}; keys: {', '.join(DATUM_KEYS)}")
        has = [bool(flag) for flag in tensor.tolist()]
        if len(has) != len(lengths):
            raise ValueError(f"{name!r} has {len(has)} flags for {len(lengths)} datums")
        values = tensors[f"value:{key}"].tolist()
        expected = sum(n for n, present in zip(lengths, has) if present)
        if len(values) != expected:
            raise ValueError(f"'value:{key}' holds {len(values)} values, the datums that have {key!r} need {expected}")
        offset = 0
        for index, present in enumerate(has):
            if present:
                inputs[index][key] = values[offset : offset + lengths[index]]
                offset += lengths[index]
    return [Datum(input_tokens=tokens[start : start + n], loss_fn_inputs=values) for start, n, values in zip(starts, lengths, inputs)]
