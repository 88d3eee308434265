"""Checks a recipe passes before an nexrl-fsdp backend loads anything: the model exists,
has a tokenizer with a chat template and room for ``rollout.max_tokens``, the device is
there. Each failure is a `ConfigError` naming the recipe key."""

from __future__ import annotations

import torch

from nexrl_core.config.errors import ConfigError
from nexrl_core.config.schema import TrainConfig
from nexrl_fsdp.loading import check_chat_model_dir, context_length, resolve_model_dir

__all__ = ["check_device", "check_model_name"]


def check_model_name(recipe: TrainConfig) -> str:
    """``model.name``, once it names a shipped model or a local Hugging Face directory
    whose tokenizer has a chat template and whose context is longer than
    ``rollout.max_tokens``."""
    name = recipe.model.name
    if name is None:
        raise ConfigError(["model.name: not set; name the model to train (nexrl-tiny, or a local Hugging Face directory)"])
    try:
        directory = resolve_model_dir(name)
        check_chat_model_dir(directory)
    except ValueError as error:
        raise ConfigError([f"model.name: {error}"]) from None
    context = context_length(directory)
    max_tokens = recipe.rollout.max_tokens
    if context is not None and max_tokens >= context:
        raise ConfigError(
            [
                f"rollout.max_tokens: {max_tokens} does not fit model {name!r}, whose context is {context} tokens "
                f"(config.json) and must also hold the prompt; use at most {context - 1}, well below for long prompts"
            ]
        )
    return name


def check_device(device: str, key: str) -> None:
    """``device`` parses as a torch device this machine has."""
    try:
        parsed = torch.device(device)
    except RuntimeError as error:
        raise ConfigError([f"{key}: {device!r} is not a torch device: {error}"]) from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError([f"{key}: {device!r} asks for CUDA, which this machine does not have; use cpu"])
