"""Options of the ``weaver`` service holder; light to import, so config validation can use it."""

from __future__ import annotations

import secrets

import attrs

from nexrl_core.holders import HolderTarget


@attrs.frozen(kw_only=True)
class WeaverHolderConfig(HolderTarget):
    """How to reach a Weaver service and what to train there (`HolderTarget`), plus the
    options only this holder has. ``base_url`` None reads ``WEAVER_BASE_URL``, else the
    SDK's hosted default; ``api_key`` None reads ``WEAVER_API_KEY``. ``model.lora.rank``
    0 creates a ``full_ft`` model, a rank > 0 a ``lora`` one."""

    tokenizer_path: str | None = None
    """Local tokenizer directory or hub id; None uses the ``tokenizer_path`` the service names."""
    tensor_transport: str | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.in_(["default", "http-binary"])))
    """``default`` (JSON tensors) or ``http-binary`` (binary tensor packs); None reads
    ``WEAVER_TENSOR_TRANSPORT``."""
    max_retries: int = attrs.field(default=4, validator=attrs.validators.ge(0))
    """Retries of a call that failed with a transient service error."""
    retry_backoff_s: float = attrs.field(default=0.5, validator=attrs.validators.gt(0))
    """First retry delay; it doubles with each retry."""
    operation_timeout_s: float = attrs.field(default=3600.0, validator=attrs.validators.gt(0))
    """Longest wait for one operation (the SDK itself waits for ever)."""
    coalesce_window_s: float = attrs.field(default=0.003, validator=attrs.validators.ge(0))
    """How long a sample request waits for others with the same prompt and options, to
    send them as one ``num_samples`` request (`nexrl_core.coalesce`); 0 sends each alone."""

    @staticmethod
    def new_api_key() -> str:
        """A fresh key in the ``sk-`` format Weaver documents."""
        return f"sk-nexrl-{secrets.token_hex(16)}"
