"""Options of the ``inprocess`` backend and its holder; light to import (no torch).

``nexrl plugins`` and recipe validation structure ``backend.options`` into
`InProcessBackendConfig` on machines without torch, so nothing here may import it.
"""

from __future__ import annotations

import attrs

from nexrl_core.config.checks import non_empty
from nexrl_core.http.serving import DEFAULT_MAX_TOKENS_PER_MICROBATCH
from nexrl_core.training.holders import HolderTarget
from nexrl_engine.batching import BatchedSamplingOptions, positive_int
from nexrl_engine.config import EngineConfig

__all__ = ["EngineHolderConfig", "EngineOptions", "InProcessBackendConfig"]


@attrs.frozen(kw_only=True)
class EngineOptions(BatchedSamplingOptions):
    """How the engine runs in the training process, beyond what the recipe's ``model`` says."""

    device: str = attrs.field(default="cpu", validator=non_empty)
    """torch device the model lives on: ``cpu``, ``cuda``, ``cuda:1``, ..."""
    max_tokens_per_microbatch: int = attrs.field(default=DEFAULT_MAX_TOKENS_PER_MICROBATCH, validator=positive_int)
    """A training step runs its datums in chunks of at most this many padded tokens; a
    smaller value saves memory and changes nothing else (each chunk's loss is divided by
    the whole step's totals, so the chunks add up to the step in every aggregation)."""
    share_prefixes: bool = True
    """Run the prompt a GRPO group shares once per training pass instead of once per
    run; the result equals the plain pass up to float rounding."""


@attrs.frozen(kw_only=True)
class InProcessBackendConfig(EngineOptions):
    """``backend.options`` of the ``inprocess`` backend: the engine options and the trainer."""

    trainer: str = attrs.field(default="remote_api_grpo", validator=non_empty)
    """Registered trainer that turns trajectories into the engine's training calls."""

    def engine_options(self) -> EngineOptions:
        """The engine half of these options."""
        return EngineOptions(**{field.name: getattr(self, field.name) for field in attrs.fields(EngineOptions)})


@attrs.frozen(kw_only=True)
class EngineHolderConfig(HolderTarget):
    """What `nexrl_engine.inprocess.holder.EngineHolder` runs: the recipe's model and seed
    (`HolderTarget`; ``base_url`` and ``api_key`` are unused), its teacher, and how."""

    engine: EngineOptions = attrs.field(factory=EngineOptions)

    def engine_config(self) -> EngineConfig:
        """The engine's own config; ``model.dtype`` (``fp32``/``bf16``) becomes the parameter
        dtype, ``model.mixed_precision`` the engine's fp32 masters under bf16 compute.

        :raises ValueError: when ``model.name`` is not set.
        """
        if self.model.name is None:
            raise ValueError("model.name is not set")
        return EngineConfig(
            model=self.model.name,
            dtype=self.model.dtype.value,
            seed=self.seed,
            lora=self.model.lora,
            device=self.engine.device,
            max_tokens_per_microbatch=self.engine.max_tokens_per_microbatch,
            share_prefixes=self.engine.share_prefixes,
            gradient_checkpointing=self.model.gradient_checkpointing,
            mixed_precision=self.model.mixed_precision,
        )
