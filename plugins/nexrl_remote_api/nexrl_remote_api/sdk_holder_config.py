"""Options every holder on a vendor SDK has (`SdkHolderConfig`); light to import, so config
validation can use it."""

from __future__ import annotations

import attrs

from nexrl_core.training.holders import HolderTarget


@attrs.frozen(kw_only=True)
class SdkHolderConfig(HolderTarget):
    """How to reach the service and what to train there (`HolderTarget`), plus what every
    `nexrl_remote_api.sdk_holder.SdkServiceHolder` does the same whatever its SDK: where
    its tokenizer comes from, how it retries and how it merges a group's samples. A holder's
    own config subclasses it with the options only its SDK has."""

    tokenizer_path: str | None = None
    """Local tokenizer directory or hub id; None uses the tokenizer the service names."""
    max_retries: int = attrs.field(default=4, validator=attrs.validators.ge(0))
    """Retries of a call that failed with a transient service error."""
    retry_backoff_s: float = attrs.field(default=0.5, validator=attrs.validators.gt(0))
    """First retry delay; it doubles with each retry."""
    coalesce_window_s: float = attrs.field(default=0.003, validator=attrs.validators.ge(0))
    """How long a sample request waits for others with the same prompt and options, to
    send them as one ``num_samples`` request (`nexrl_core.training.coalesce`); 0 sends each alone."""
