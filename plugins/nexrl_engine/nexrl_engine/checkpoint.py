"""Checkpoints as safetensors plus a JSON manifest, and merged HF exports.

No pickle anywhere: a checkpoint may come from another tenant of a shared service, and
unpickling runs code. A checkpoint directory holds

* ``weights.safetensors``: the trainable parameters by name (LoRA adapters only for
  LoRA, every parameter for full fine-tuning);
* ``optimizer.safetensors`` (optional): AdamW moments and step counts by parameter name;
* ``nexrl_checkpoint.json``: base model, dtype, LoRA settings, optimizer step, files.

The manifest is written last, so a directory with a manifest is complete.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors.torch import load_file, save_file

__all__ = [
    "CHECKPOINT_FORMAT",
    "CheckpointManifest",
    "MANIFEST_NAME",
    "OPTIMIZER_NAME",
    "WEIGHTS_NAME",
    "LoadedState",
    "read_for_loading",
    "read_manifest",
    "read_optimizer",
    "read_weights",
    "write_checkpoint",
]

CHECKPOINT_FORMAT = "nexrl-fsdp-checkpoint"
"""The manifest's format id, kept from when the engine lived in nexrl-fsdp so that every
checkpoint written since still loads."""
CHECKPOINT_VERSION = 1
MANIFEST_NAME = "nexrl_checkpoint.json"
WEIGHTS_NAME = "weights.safetensors"
OPTIMIZER_NAME = "optimizer.safetensors"


@attrs.frozen(kw_only=True)
class CheckpointManifest:
    """What a checkpoint was saved from; loading checks it against the engine."""

    base_model: str
    dtype: str
    lora: dict[str, Any] | None
    """`LoraSettings` as a dict, or None for full fine-tuning."""
    step: int
    has_optimizer: bool
    parameters: list[str]
    format: str = CHECKPOINT_FORMAT
    version: int = CHECKPOINT_VERSION


def _save_tensors(tensors: Mapping[str, torch.Tensor], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)


def write_checkpoint(
    directory: str | Path,
    manifest: CheckpointManifest,
    weights: Mapping[str, torch.Tensor],
    optimizer_state: Mapping[str, torch.Tensor] | None,
) -> Path:
    """Write a checkpoint directory (created if missing, files replaced if present)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    manifest_path = directory / MANIFEST_NAME
    if manifest_path.exists():
        manifest_path.unlink()
    _save_tensors(weights, directory / WEIGHTS_NAME)
    optimizer_path = directory / OPTIMIZER_NAME
    if optimizer_state is not None:
        _save_tensors(optimizer_state, optimizer_path)
    elif optimizer_path.exists():
        optimizer_path.unlink()
    tmp = manifest_path.with_name(MANIFEST_NAME + ".tmp")
    tmp.write_text(json.dumps(attrs.asdict(manifest), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, manifest_path)
    return directory


def read_manifest(directory: str | Path) -> CheckpointManifest:
    """Read and check a manifest; a missing or foreign one is a ValueError."""
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        raise ValueError(f"{str(directory)!r} is not a NexRL engine checkpoint: {MANIFEST_NAME} is missing")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"checkpoint manifest {str(path)!r} is not valid JSON: {exc}") from None
    if data.get("format") != CHECKPOINT_FORMAT or data.get("version") != CHECKPOINT_VERSION:
        raise ValueError(
            f"checkpoint manifest {str(path)!r} has format {data.get('format')!r} version {data.get('version')!r}; "
            f"expected {CHECKPOINT_FORMAT!r} version {CHECKPOINT_VERSION}"
        )
    fields = {field.name for field in attrs.fields(CheckpointManifest)}
    return CheckpointManifest(**{key: value for key, value in data.items() if key in fields})


def read_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(directory) / WEIGHTS_NAME))


def read_optimizer(directory: str | Path) -> dict[str, torch.Tensor]:
    path = Path(directory) / OPTIMIZER_NAME
    if not path.is_file():
        raise ValueError(f"checkpoint {str(directory)!r} was saved without optimizer state")
    return load_file(str(path))


@attrs.frozen
class LoadedState:
    """A checkpoint read for loading, checked against the model it goes into."""

    manifest: CheckpointManifest
    weights: dict[str, torch.Tensor]
    optimizer_state: dict[str, torch.Tensor] | None
    """None unless the optimizer was asked for."""


def read_for_loading(
    directory: str | Path,
    *,
    base_model: str,
    lora: dict[str, Any] | None,
    shapes: Mapping[str, tuple[int, ...]],
    load_optimizer: bool,
) -> LoadedState:
    """Read a checkpoint for a model of ``base_model`` with ``lora`` settings (None: full
    fine-tuning) whose trainable parameters have ``shapes``, and the optimizer state
    with ``load_optimizer``.

    :raises ValueError: naming what does not match: the base model, the LoRA settings,
        a missing optimizer state, missing or unexpected parameters, a shape.
    """
    manifest = read_manifest(directory)
    if manifest.base_model != base_model:
        raise ValueError(f"checkpoint {str(directory)!r} was saved from base model {manifest.base_model!r}, this model runs {base_model!r}")
    if manifest.lora != lora:
        raise ValueError(f"checkpoint {str(directory)!r} has LoRA settings {manifest.lora}, this model has {lora}")
    if load_optimizer and not manifest.has_optimizer:
        raise ValueError(f"checkpoint {str(directory)!r} was saved without optimizer state; load it with load_optimizer=False")
    weights = read_weights(directory)
    missing, unexpected = sorted(set(shapes) - set(weights)), sorted(set(weights) - set(shapes))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {str(directory)!r} does not match the trainable parameters of this model: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    for name, tensor in weights.items():
        if tuple(tensor.shape) != tuple(shapes[name]):
            raise ValueError(f"checkpoint parameter {name!r} has shape {tuple(tensor.shape)}, expected {tuple(shapes[name])}")
    return LoadedState(manifest, weights, read_optimizer(directory) if load_optimizer else None)
