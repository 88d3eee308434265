"""Activation (gradient) checkpointing of an HF causal LM for training passes only.

``model.gradient_checkpointing: true`` turns it on in the engine and on the self-hosted
workers. Transformers checkpoints a decoder layer only while that layer is in training
mode, and NexRL keeps its models in eval mode for good (dropout would make the training
pass disagree with sampling), so `training_pass` puts just the layers that checkpoint in
training mode for one pass: their submodules (attention dropout) stay in eval mode, so
the pass computes what it computes without checkpointing and keeps fewer activations.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["enable_checkpointing", "is_checkpointing", "training_pass"]


def _hf_model(model: torch.nn.Module) -> Any:
    """The transformers model inside ``model`` (itself, or the one a peft wrapper holds)."""
    for module in model.modules():
        if hasattr(module, "supports_gradient_checkpointing") and hasattr(module, "gradient_checkpointing_enable"):
            return module
    raise ValueError(f"{type(model).__name__} holds no transformers model to checkpoint")


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Checkpoint every decoder layer of ``model`` (non-reentrant, so frozen inputs, as
    under LoRA, need no ``requires_grad``).

    :raises ValueError: for a model whose architecture does not support it.
    """
    hf = _hf_model(model)
    if not hf.supports_gradient_checkpointing:
        raise ValueError(f"{type(hf).__name__} does not support gradient checkpointing")
    kwargs = {"use_reentrant": False}
    if hasattr(hf, "activation_checkpointing_enable"):
        hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers before activation_checkpointing_enable
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def is_checkpointing(model: torch.nn.Module) -> bool:
    """Whether ``model``'s layers checkpoint in training passes (transformers' own flag)."""
    hf = _hf_model(model)
    flag = getattr(hf, "is_activation_checkpointing", None)
    if flag is None:
        flag = hf.is_gradient_checkpointing
    return bool(flag)


@contextlib.contextmanager
def training_pass(model: torch.nn.Module, checkpointing: bool) -> Iterator[None]:
    """Within, the layers of ``model`` that checkpoint do (when ``checkpointing``); only
    their own ``training`` flag changes, and it is restored after."""
    if not checkpointing:
        yield
        return
    layers = [module for module in model.modules() if getattr(module, "gradient_checkpointing", False) is True and not module.training]
    for layer in layers:
        layer.training = True
    try:
        yield
    finally:
        for layer in layers:
            layer.training = False
