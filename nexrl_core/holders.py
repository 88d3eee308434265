"""The service holder: one object that both samples from and trains a model on a backend.

Rollout workers and the trainer share one holder, so sampling always sees the weights
the trainer last published. A holder must survive being pickled into another process
(for rollout workers elsewhere): it pickles to its config and reconnects on first use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import attrs

from nexrl_core.types import RemoteDatum, SampleResult


@attrs.frozen(kw_only=True)
class SamplingOptions:
    """How one completion is sampled."""

    max_tokens: int = attrs.field(default=64, validator=attrs.validators.gt(0))
    temperature: float = attrs.field(default=1.0, validator=attrs.validators.ge(0))
    top_p: float = attrs.field(default=1.0, validator=[attrs.validators.gt(0), attrs.validators.le(1)])
    top_k: int = -1
    """-1 disables top-k."""
    stop: Sequence[str] | Sequence[int] | None = None
    """Stop strings or token ids; None uses the chat template's end-of-turn markers."""
    seed: int | None = None


@attrs.frozen(kw_only=True)
class TrainStepConfig:
    """One optimisation step on a remote API: the loss and every AdamW parameter.

    The original NexRL dropped weight decay and gradient clipping on the way to the
    service; every field here reaches the optimizer.
    """

    loss_fn: str = "importance_sampling"
    """Loss name understood by the backend (and by NexRL's policy-loss registry)."""
    loss_fn_config: dict[str, float] = attrs.field(factory=dict)
    """Loss options in the backend's vocabulary (e.g. Tinker's ``clip_low_threshold``)."""
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.01
    grad_clip_norm: float = 1.0


class ServiceHolder(Protocol):
    """Sampling and training on one backend; see ``docs/plugins.md``."""

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
    ) -> str | list[int]:
        """Render chat messages with the model's template; token ids when ``tokenize``."""
        ...

    def sample_from_prompt(self, prompt_tokens: Sequence[int], options: SamplingOptions) -> SampleResult:
        """Sample one completion of a tokenised prompt."""
        ...

    def sample_from_messages(
        self,
        messages: Sequence[dict[str, Any]],
        options: SamplingOptions,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> SampleResult:
        """Render ``messages`` (and ``tools``), sample one assistant turn, parse its tool calls."""
        ...

    def train(self, datums: Sequence[RemoteDatum], config: TrainStepConfig) -> dict[str, float]:
        """One forward-backward pass over ``datums`` and one optimizer step; returns metrics."""
        ...

    def update_sampling_weights(self, weight_path: str | None = None) -> str:
        """Point sampling at ``weight_path``, or at freshly saved current weights; returns the path."""
        ...

    def save_checkpoint(self, name: str) -> str:
        """Save weights and optimizer state under ``name``; returns a path `load_checkpoint` takes."""
        ...

    def load_checkpoint(self, path: str) -> None:
        """Continue training from a checkpoint saved by `save_checkpoint` (weights and optimizer)."""
        ...

    def close(self) -> None:
        """Release connections and background threads."""
        ...
