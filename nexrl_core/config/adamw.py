"""`AdamWSettings`: the one record of AdamW hyper-parameters.

The recipe's ``algorithm`` section, the step a trainer sends to a remote API, and the
engine's ``optim_step`` all take this record, so a field added here reaches every
optimizer and none can be dropped on the way (the original NexRL lost weight decay
and gradient clipping between its trainer and the service).
"""

from __future__ import annotations

import attrs

from nexrl_core.config.checks import fraction_below_one, non_negative, positive


@attrs.frozen(kw_only=True)
class AdamWSettings:
    """AdamW with decoupled weight decay and global-norm gradient clipping."""

    learning_rate: float = attrs.field(default=1e-4, validator=non_negative)
    """Step size."""
    beta1: float = attrs.field(default=0.9, validator=fraction_below_one)
    """First-moment decay."""
    beta2: float = attrs.field(default=0.95, validator=fraction_below_one)
    """Second-moment decay."""
    eps: float = attrs.field(default=1e-8, validator=positive)
    """Denominator epsilon."""
    weight_decay: float = attrs.field(default=0.01, validator=non_negative)
    """Decoupled: each step multiplies the weights by ``1 - learning_rate * weight_decay``."""
    grad_clip_norm: float = attrs.field(default=1.0, validator=non_negative)
    """Gradients are rescaled so their global norm is at most this; 0 disables clipping."""

    def to_json(self) -> dict[str, float]:
        """Every field by name, e.g. for a wire format that spells them the same way."""
        return attrs.asdict(self)
