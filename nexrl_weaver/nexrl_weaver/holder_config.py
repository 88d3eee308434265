"""Options of the ``weaver`` service holder; light to import, so config validation can use it."""

from __future__ import annotations

import secrets

import attrs

from nexrl_remote_api.sdk_holder_config import SdkHolderConfig


@attrs.frozen(kw_only=True)
class WeaverHolderConfig(SdkHolderConfig):
    """How to reach a Weaver service and what to train there (`SdkHolderConfig`), plus the
    options only this holder has. ``base_url`` None reads ``WEAVER_BASE_URL``, else the
    SDK's hosted default; ``api_key`` None reads ``WEAVER_API_KEY``. ``model.lora.rank``
    0 creates a ``full_ft`` model, a rank > 0 a ``lora`` one."""

    tensor_transport: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.in_(["default", "http-binary"]))
    )
    """``default`` (JSON tensors) or ``http-binary`` (binary tensor packs); None reads
    ``WEAVER_TENSOR_TRANSPORT``."""
    operation_timeout_s: float = attrs.field(default=3600.0, validator=attrs.validators.gt(0))
    """Longest wait for one operation (the SDK itself waits for ever)."""

    @staticmethod
    def new_api_key() -> str:
        """A fresh key in the ``sk-`` format Weaver documents."""
        return f"sk-nexrl-{secrets.token_hex(16)}"
