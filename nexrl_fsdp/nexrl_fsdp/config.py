"""Options of the engine, validated when the record is built.

A bad value fails here with the field name, before any model is loaded, so a typo in a
recipe costs a second and not a model load.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

__all__ = ["DTYPES", "EngineConfig", "LoraSettings"]

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


def _positive_number(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must be a finite number > 0, got {value!r}")


def _bool(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must be true or false, got {value!r}")


def _non_empty_str(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must be a non-empty string, got {value!r}")


@attrs.frozen(kw_only=True)
class LoraSettings:
    """Which LoRA adapters to train; also stored in checkpoint manifests.

    ``rank == 0`` means full fine-tuning (every parameter trains and the flags are
    ignored), which is what Tinker's ``rank`` semantics suggest for a self-hosted engine.
    """

    rank: int = attrs.field(default=0, validator=_int_at_least(0))
    alpha: float = attrs.field(default=32.0, validator=_positive_number)
    """LoRA scale is ``alpha / rank``."""
    train_mlp: bool = attrs.field(default=True, validator=_bool)
    """Adapt the MLP projections (gate/up/down or their equivalents)."""
    train_attn: bool = attrs.field(default=True, validator=_bool)
    """Adapt the attention projections (q/k/v/o)."""
    train_unembed: bool = attrs.field(default=True, validator=_bool)
    """Adapt the output projection (``lm_head``)."""

    @property
    def is_lora(self) -> bool:
        return self.rank > 0

    def __attrs_post_init__(self) -> None:
        if self.rank > 0 and not (self.train_mlp or self.train_attn or self.train_unembed):
            raise ValueError("LoRA with rank > 0 needs at least one of train_mlp, train_attn, train_unembed")

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen(kw_only=True)
class EngineConfig:
    """Everything that decides what the engine loads and how it trains.

    Attributes mirror Tinker's ``create_lora_training_client(base_model, rank, seed,
    train_mlp, train_attn, train_unembed)`` so a local Tinker-compatible service can pass
    them through unchanged.
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
    lora_rank: int = attrs.field(default=0, validator=_int_at_least(0))
    """0 = full fine-tuning."""
    lora_alpha: float = attrs.field(default=32.0, validator=_positive_number)
    train_mlp: bool = attrs.field(default=True, validator=_bool)
    train_attn: bool = attrs.field(default=True, validator=_bool)
    train_unembed: bool = attrs.field(default=True, validator=_bool)
    device: str = attrs.field(default="cpu", validator=_non_empty_str)
    """torch device string, e.g. ``cpu`` or ``cuda:0``."""
    max_tokens_per_microbatch: int = attrs.field(default=16384, validator=_int_at_least(1))
    """forward/forward_backward split a batch of datums into chunks of at most this many
    padded tokens (always at least one datum per chunk). Tinker losses are sums, so the
    chunking changes memory use, not the result."""
    share_prefixes: bool = attrs.field(default=True, validator=_bool)
    """forward/forward_backward run a prefix shared by several datums (a GRPO group's
    prompt) once and only each datum's own tokens again (`nexrl_fsdp.shared_prefix`);
    results equal the plain pass up to float rounding."""

    @property
    def lora(self) -> LoraSettings:
        return LoraSettings(
            rank=self.lora_rank,
            alpha=self.lora_alpha,
            train_mlp=self.train_mlp,
            train_attn=self.train_attn,
            train_unembed=self.train_unembed,
        )

    def __attrs_post_init__(self) -> None:
        self.lora  # validates the LoRA combination early
