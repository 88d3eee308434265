"""Checks a recipe passes before an nexrl-fsdp backend loads anything: the model exists,
the device is there. Each failure is a `ConfigError` naming the recipe key."""

from __future__ import annotations

import torch

from nexrl_core.config.errors import ConfigError
from nexrl_core.config.schema import TrainConfig
from nexrl_fsdp.loading import resolve_model_dir

__all__ = ["check_device", "check_model_name"]


def check_model_name(recipe: TrainConfig) -> str:
    """``model.name``, once it names a shipped model or a local Hugging Face directory."""
    name = recipe.model.name
    if name is None:
        raise ConfigError(["model.name: not set; name the model to train (nexrl-tiny, or a local Hugging Face directory)"])
    try:
        resolve_model_dir(name)
    except ValueError as error:
        raise ConfigError([f"model.name: {error}"]) from None
    return name


def check_device(device: str, key: str) -> None:
    """``device`` parses as a torch device this machine has."""
    try:
        parsed = torch.device(device)
    except RuntimeError as error:
        raise ConfigError([f"{key}: {device!r} is not a torch device: {error}"]) from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError([f"{key}: {device!r} asks for CUDA, which this machine does not have; use cpu"])
