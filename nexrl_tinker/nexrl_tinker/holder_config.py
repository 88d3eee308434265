"""Options of the ``tinker`` service holder; light to import, so config validation can use it."""

from __future__ import annotations

import attrs


@attrs.frozen(kw_only=True)
class TinkerHolderConfig:
    """How to reach a Tinker service and what to train there."""

    base_url: str | None = None
    """Service URL; None uses the SDK's default (hosted Tinker, or ``TINKER_BASE_URL``)."""
    base_model: str = "nexrl-tiny"
    """Model to train, as the service names it."""
    lora_rank: int = attrs.field(default=32, validator=attrs.validators.ge(0))
    """LoRA rank; NexRL's local service takes 0 as full fine-tuning, hosted Tinker needs > 0."""
    seed: int = 0
    """Seed of the LoRA initialisation."""
    api_key: str | None = None
    """Tinker API key (``tml-...``); None lets the SDK read ``TINKER_API_KEY``."""
    tokenizer_path: str | None = None
    """Local tokenizer directory; None asks the service (``get_info``'s tokenizer id)."""
    renderer_name: str | None = None
    """A tinker-cookbook renderer (``qwen3``, ``llama3``, ...) instead of the tokenizer's chat template."""
    max_retries: int = attrs.field(default=4, validator=attrs.validators.ge(0))
    """Retries of a call that failed with a transient service error."""
    retry_backoff_s: float = attrs.field(default=0.5, validator=attrs.validators.gt(0))
    """First retry delay; it doubles with each retry."""
    coalesce_window_s: float = attrs.field(default=0.003, validator=attrs.validators.ge(0))
    """How long a sample request waits for others with the same prompt and options, to
    send them as one ``num_samples`` request (`nexrl_core.coalesce`); 0 sends each alone."""
