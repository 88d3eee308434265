"""Options of the ``tinker`` service holder; light to import, so config validation can use it."""

from __future__ import annotations

import secrets

import attrs

from nexrl_core.holders import HolderTarget


@attrs.frozen(kw_only=True)
class TinkerHolderConfig(HolderTarget):
    """How to reach a Tinker service and what to train there (`HolderTarget`), plus the
    options only this holder has. ``api_key`` is a ``tml-...`` key; None lets the SDK
    read ``TINKER_API_KEY``. ``model.lora.rank`` 0 is full fine-tuning on NexRL's local
    service; hosted Tinker needs a rank > 0."""

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

    @staticmethod
    def new_api_key() -> str:
        """A fresh key in the format the Tinker SDK accepts (it refuses keys without ``tml-``)."""
        return f"tml-nexrl-{secrets.token_hex(16)}"
