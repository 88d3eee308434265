"""Options of the engine, validated when the record is built.

A bad value fails here with the field name, before any model is loaded, so a typo in a
recipe costs a second and not a model load.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from nexrl_core.config.lora import LoraSettings
from nexrl_core.http.serving import DEFAULT_MAX_TOKENS_PER_MICROBATCH

__all__ = ["DTYPES", "EngineConfig", "TrainingSpec"]

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
"""Accepted spellings of the two supported parameter dtypes, mapped to the canonical name."""


def _canonical_dtype(value: Any) -> str:
    canonical = DTYPES.get(str(value).lower()) if isinstance(value, str) else None
    if canonical is None:
        raise ValueError(f"dtype must be one of {', '.join(sorted(DTYPES))}, got {value!r}")
    return canonical


def _int_at_least(minimum: int) -> Any:
    def validate(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{type(instance).__name__}.{attribute.name} must be an integer >= {minimum}, got {value!r}")

    return validate


def _bool(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must be true or false, got {value!r}")


def _bfloat16_only(instance: Any, attribute: attrs.Attribute, value: bool) -> None:
    if value and instance.dtype != "bfloat16":
        raise ValueError(
            f"{type(instance).__name__}.mixed_precision needs dtype bfloat16 (fp32 masters under bfloat16 compute), "
            f"got dtype {instance.dtype}"
        )


def _lora_settings(value: Any) -> LoraSettings:
    return LoraSettings(**value) if isinstance(value, Mapping) else value


def _non_empty_str(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must be a non-empty string, got {value!r}")


@attrs.frozen(kw_only=True)
class EngineConfig:
    """Everything that decides what the engine loads and how it trains.

    Attributes mirror a training API's ``create_model`` (Tinker's
    ``create_lora_training_client(base_model, rank, seed, train_mlp, train_attn,
    train_unembed)``) so a local service can pass them through unchanged.
    """

    model: str = attrs.field(default="nexrl-tiny", validator=_non_empty_str)
    """A shipped model name (``nexrl-tiny``) or a local directory holding an HF causal LM
    and its tokenizer."""
    dtype: str = attrs.field(default="float32", converter=_canonical_dtype)
    """Parameter dtype: ``float32`` or ``bfloat16``. Logprobs are always computed in
    float32 from the logits."""
    seed: int = attrs.field(default=0, validator=_int_at_least(0))
    """Seeds LoRA initialisation and the stream of sampling seeds used when a request
    gives none."""
    lora: LoraSettings = attrs.field(factory=LoraSettings, converter=_lora_settings)
    """Full fine-tuning (the default) or LoRA; a dict of `LoraSettings` fields works too."""
    device: str = attrs.field(default="cpu", validator=_non_empty_str)
    """torch device string, e.g. ``cpu`` or ``cuda:0``."""
    max_tokens_per_microbatch: int = attrs.field(default=DEFAULT_MAX_TOKENS_PER_MICROBATCH, validator=_int_at_least(1))
    """forward/forward_backward split a batch of datums into chunks of at most this many
    padded tokens (always at least one datum per chunk). Tinker losses are sums, so the
    chunking changes memory use, not the result."""
    share_prefixes: bool = attrs.field(default=True, validator=_bool)
    """forward/forward_backward run a prefix shared by several datums (a GRPO group's
    prompt) once and only each datum's own tokens again (`nexrl_engine.shared_prefix`);
    results equal the plain pass up to float rounding."""
    gradient_checkpointing: bool = attrs.field(default=False, validator=_bool)
    """Recompute each decoder layer's activations in the backward pass of forward_backward
    instead of keeping them (``model.gradient_checkpointing``): less memory, the same
    gradients. Those passes do not share prefixes; sampling and forward are unaffected."""
    mixed_precision: bool = attrs.field(default=False, validator=[_bool, _bfloat16_only])
    """With ``dtype`` ``bfloat16``: the optimizer steps fp32 master copies of the trained
    weights (fp32 AdamW moments too) while the model computes in bfloat16
    (``model.mixed_precision``; `nexrl_engine.mixed_precision.MasterWeights` says how).
    Checkpoints hold the masters; sampling, scoring and exports use the bfloat16 weights
    they round to."""


@attrs.frozen
class TrainingSpec:
    """How a training model's engine is configured (what the client asked at creation)."""

    base_model: str
    lora: LoraSettings = attrs.field(factory=LoraSettings)
    lora_seed: int = 0

    def engine_config(
        self, dtype: str, device: str = "cpu", max_tokens_per_microbatch: int = DEFAULT_MAX_TOKENS_PER_MICROBATCH
    ) -> EngineConfig:
        """The model's engine config; the precision, device and micro-batch budget are the
        service's (the same for every model it trains), the rest the model's creation."""
        return EngineConfig(
            model=self.base_model,
            lora=self.lora,
            seed=self.lora_seed,
            dtype=dtype,
            device=device,
            max_tokens_per_microbatch=max_tokens_per_microbatch,
        )
