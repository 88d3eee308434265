"""`LoraSettings`: the one record of which weights a run trains.

The recipe's ``model.lora``, the in-process engine, the local services' training
models and every holder's ``create_model`` call read this record, so a LoRA field
added here reaches each of them or is refused by the holder that cannot honour it.
"""

from __future__ import annotations

from typing import Any

import attrs

from nexrl_core.config.checks import non_negative_int, positive

DEFAULT_ALPHA = 32.0
"""The scale numerator a service uses when its wire has no alpha (Tinker's and Weaver's
have none), so a holder refuses any other value on such a wire."""


@attrs.frozen(kw_only=True)
class LoraSettings:
    """Full fine-tuning (``rank`` 0) or LoRA adapters of ``rank`` on the chosen layers."""

    rank: int = attrs.field(default=0, validator=non_negative_int)
    """Rank of the LoRA adapters; 0 trains every weight and ignores the other fields."""
    alpha: float = attrs.field(default=DEFAULT_ALPHA, validator=positive)
    """Adapters are scaled by ``alpha / rank``."""
    train_mlp: bool = True
    """Adapt the MLP projections (gate/up/down or their equivalents)."""
    train_attn: bool = True
    """Adapt the attention projections (q/k/v/o)."""
    train_unembed: bool = True
    """Adapt the output projection (``lm_head``)."""

    def __attrs_post_init__(self) -> None:
        if self.is_lora and not (self.train_mlp or self.train_attn or self.train_unembed):
            raise ValueError("LoRA with rank > 0 needs at least one of train_mlp, train_attn, train_unembed")

    @property
    def is_lora(self) -> bool:
        """True when adapters train instead of every weight."""
        return self.rank > 0

    def to_json(self) -> dict[str, Any]:
        """Every field by name, as checkpoint manifests store it."""
        return attrs.asdict(self)
