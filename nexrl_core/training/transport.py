"""What a transport is: the client that carries a self-hosted trainer's batches to its workers.

A plugin registers one with ``nexrl_transports`` (`nexrl_core.plugins.specs.TransportSpec`); the
factory takes the spec's config and returns an object with these methods.
`nexrl_core.testing.TransportContract` is the bar every transport meets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from nexrl_core.config.lora import LoraSettings
    from nexrl_core.training.batch import Batch


class Transport(Protocol):
    """Drives one group of training workers; one op at a time."""

    def initialize_worker(self) -> dict[str, Any]:
        """Wait until every worker has reported itself; returns what the group reported."""
        ...

    def init_model(
        self,
        model: str,
        dtype: str = "float32",
        seed: int = 0,
        lora: LoraSettings | None = None,
        gradient_checkpointing: bool = False,
        mixed_precision: bool = False,
    ) -> dict[str, Any]:
        """Load the model on every worker, training every weight or the LoRA adapters
        ``lora`` asks for, with activation checkpointing in training passes when
        ``gradient_checkpointing``, and with ``mixed_precision`` fp32 master weights
        under ``dtype`` (bfloat16) compute; returns at least ``vocab_size`` and ``pad_token_id``."""
        ...

    def update_actor(self, batch: Batch, options: Mapping[str, Any]) -> dict[str, float]:
        """Train on ``batch`` with the loss and optimizer in ``options``; returns float metrics."""
        ...

    def compute_log_prob(self, batch: Batch, micro_batch_rows: int = 8, max_tokens_per_microbatch: int | None = None) -> torch.Tensor:
        """[B, L] logprob of each token under the policy (0 on padding and first tokens),
        at most ``micro_batch_rows`` rows and ``max_tokens_per_microbatch`` padded tokens
        (None: no token limit) per forward on a worker."""
        ...

    def compute_ref_log_prob(self, batch: Batch, micro_batch_rows: int = 8, max_tokens_per_microbatch: int | None = None) -> torch.Tensor:
        """[B, L] logprobs under the frozen reference weights, in passes as `compute_log_prob`'s."""
        ...

    def save_checkpoint(self, path: str) -> str:
        """Save what resuming needs under ``path``; returns the path `load_checkpoint` takes."""
        ...

    def load_checkpoint(self, path: str) -> None:
        """Continue from `save_checkpoint`'s path."""
        ...

    def destroy(self) -> None:
        """End the worker group."""
        ...
