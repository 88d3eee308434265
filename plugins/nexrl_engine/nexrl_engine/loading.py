"""Find and load a causal LM and its tokenizer from local files only, and write one back.

The engine never downloads: a model is either one shipped inside this package (by
name) or a local directory an HF ``save_pretrained`` wrote. Everything else fails
with a ValueError that lists what would have worked. `save_hf_directory` writes such a
directory, the one way every export here (the engine's, the workers') does it.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.resources
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

__all__ = [
    "SHIPPED_HUB_NAMES",
    "SHIPPED_MODELS",
    "HubNames",
    "check_chat_model_dir",
    "context_length",
    "load_model",
    "load_tokenizer",
    "quiet_progress",
    "resolve_model_dir",
    "save_hf_directory",
    "shipped_model_dir",
    "torch_dtype",
]

CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
"""``config.json`` keys that hold a model's context length, by architecture."""

SHIPPED_MODELS: dict[str, str] = {"nexrl-tiny": "models/nexrl-tiny"}
"""Shipped model name → directory inside the ``nexrl_engine`` package."""


@attrs.frozen
class HubNames:
    """The Hugging Face-style names a service serves a shipped model under."""

    model_name: str
    """What clients and tinker-cookbook call the model (``model_info``, ``hyperparam_utils``,
    ``SamplingClient.get_tokenizer()``): a name in the cookbook's tables whose renderer
    writes exactly the model's chat template."""
    tokenizer_id: str
    """The name its tokenizer is fetched by (``TrainingClient.get_tokenizer()``): one that
    names no repository on the Hub, so that a client that can reach the Hub never gets
    the real model's tokenizer in place of this one."""


SHIPPED_HUB_NAMES: dict[str, HubNames] = {
    # A qwen2 model whose chat template is ChatML with <|im_end|> as the stop token and no
    # thinking block: the cookbook's ``qwen3_instruct`` renderer, whose smallest model this is.
    "nexrl-tiny": HubNames(model_name="Qwen/Qwen3-4B-Instruct-2507", tokenizer_id="nexrl/nexrl-tiny"),
}
"""Shipped model name → the names a service serves it under by default (``--model-name``
replaces the first)."""


def shipped_model_dir(name: str) -> Path:
    """Directory of a shipped model (it may not exist in a checkout that never built it)."""
    try:
        relative = SHIPPED_MODELS[name]
    except KeyError:
        raise ValueError(f"unknown shipped model {name!r}; shipped: {', '.join(SHIPPED_MODELS)}") from None
    return Path(str(importlib.resources.files("nexrl_engine").joinpath(relative)))


def resolve_model_dir(model: str | Path) -> Path:
    """A shipped name or a local directory holding ``config.json`` → that directory."""
    text = str(model)
    if text in SHIPPED_MODELS:
        path = shipped_model_dir(text)
        if not (path / "config.json").is_file():
            raise ValueError(f"shipped model {text!r} is missing at {path}; rebuild it with `python -m nexrl_engine.tiny.build`")
        return path
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {str(path)!r} has no config.json; expected an HF save_pretrained directory")
        return path.resolve()
    raise ValueError(
        f"unknown model {text!r}: not a shipped model name ({', '.join(SHIPPED_MODELS)}) and not a local "
        f"directory; models are never downloaded, pass a directory written by save_pretrained"
    )


def context_length(path: Path) -> int | None:
    """The model's context in tokens, from its ``config.json``; None when it does not say."""
    import json

    config = json.loads((path / "config.json").read_text())
    for key in CONTEXT_KEYS:
        if isinstance(config.get(key), int):
            return int(config[key])
    return None


def check_chat_model_dir(path: Path) -> None:
    """A model directory chat rollouts can use: its tokenizer loads and has a chat template.

    Checked before anything starts, because without a template every rollout fails only
    once sampling begins.

    :raises ValueError: saying what is missing and how to add it.
    """
    tokenizer = load_tokenizer(path)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the tokenizer in {str(path)!r} has no chat template, which chat rollouts need; save one with "
            "tokenizer.chat_template = ...; tokenizer.save_pretrained(directory) (it lands in chat_template.jinja), "
            "or use an instruct model's directory"
        )


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    """Hide transformers' per-call progress bars (loading/writing shards) for the
    duration; the engine loads and saves often and the bars would flood server logs."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def torch_dtype(name: str) -> torch.dtype:
    """Canonical dtype name (see `nexrl_engine.config.DTYPES`) → torch dtype."""
    mapping = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    try:
        return mapping[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; use float32 or bfloat16") from None


def load_model(path: Path, dtype: torch.dtype, device: str | torch.device = "cpu") -> Any:
    """Load an HF causal LM from a local directory, in eval mode.

    Eval mode for good: dropout would make the training forward pass disagree with the
    sampler's logprobs, and on-policy ratios must be 1.
    """
    from transformers import AutoModelForCausalLM

    with quiet_progress():
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    model.to(device)  # type: ignore[arg-type]  # transformers wraps `to` with functools.wraps(Module.to), which mypy reads unbound (self first)
    model.eval()
    return model


def load_tokenizer(path: Path) -> Any:
    """The tokenizer saved next to the model."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises several types for a missing tokenizer
        raise ValueError(f"cannot load a tokenizer from {str(path)!r}: {exc}") from exc


def save_hf_directory(path: Path, model: Any, tokenizer: Any, state_dict: Mapping[str, torch.Tensor] | None = None) -> Path:
    """Write ``model`` and ``tokenizer`` as a plain HF directory (safetensors weights,
    ``config.json``, generation config, tokenizer and chat template) that `load_model`
    and ``transformers.AutoModelForCausalLM.from_pretrained`` read back; returns ``path``.

    :param state_dict: the weights to write instead of the model's own, e.g. a sharded
        model's gathered whole (the model then only supplies its config and layout). A
        weight the model ties to another (a tied output head) is written once, as the
        model's own save writes it: the gathered copies no longer share storage. The
        config then names the dtype of these weights, not of the model's parameters
        (mixed precision's fp32 master shards are exported in bfloat16), so that a
        loader asking for the saved dtype gets the one written.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if state_dict is not None:
        aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)} - {name for name, _ in model.named_parameters()}
        state_dict = {name: tensor for name, tensor in state_dict.items() if name not in aliases}
    with quiet_progress():
        model.save_pretrained(str(path), state_dict=state_dict)
        tokenizer.save_pretrained(str(path))
    written = {tensor.dtype for tensor in (state_dict or {}).values() if tensor.is_floating_point()}
    if len(written) == 1 and written != {model.dtype}:
        config = copy.deepcopy(model.config)
        config.dtype = str(written.pop()).removeprefix("torch.")
        config.save_pretrained(str(path))
    return path
