"""Options of the ``tinker`` service holder; light to import, so config validation can use it."""

from __future__ import annotations

import secrets

import attrs

from nexrl_remote_api.sdk_holder_config import SdkHolderConfig


@attrs.frozen(kw_only=True)
class TinkerHolderConfig(SdkHolderConfig):
    """How to reach a Tinker service and what to train there (`SdkHolderConfig`), plus the
    options only this holder has. ``api_key`` is a ``tml-...`` key; None lets the SDK
    read ``TINKER_API_KEY``. ``model.lora.rank`` 0 is full fine-tuning on NexRL's local
    service; hosted Tinker needs a rank > 0."""

    renderer_name: str | None = None
    """A tinker-cookbook renderer (``qwen3``, ``llama3``, ...) instead of the tokenizer's chat template;
    None uses the one the cookbook recommends for the model, else the chat template."""

    @staticmethod
    def new_api_key() -> str:
        """A fresh key in the format the Tinker SDK accepts (it refuses keys without ``tml-``)."""
        return f"tml-nexrl-{secrets.token_hex(16)}"
