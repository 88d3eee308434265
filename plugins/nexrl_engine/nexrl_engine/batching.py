"""How an engine's compute thread batches concurrent sample requests; light to import (no
torch), since backend options that embed it are structured on machines without torch."""

from __future__ import annotations

import attrs

from nexrl_core.config.checks import Check, non_negative

__all__ = ["BatchedSamplingOptions", "positive_int"]

positive_int = Check("must be an integer > 0", lambda value: isinstance(value, int) and not isinstance(value, bool) and value > 0)


@attrs.frozen(kw_only=True)
class BatchedSamplingOptions:
    """How a compute thread batches the rollouts' concurrent sample requests."""

    sample_linger_s: float = attrs.field(default=0.008, validator=non_negative)
    """While rollouts send sample requests in bursts, the compute thread waits until
    none has arrived for this long before it samples them as one batch; 0 never waits.
    A rollout that samples one request at a time never waits."""
    sample_linger_max_s: float = attrs.field(default=0.1, validator=non_negative)
    """The longest the compute thread waits for a burst to end."""
    max_batch_rows: int = attrs.field(default=256, validator=positive_int)
    """Most samples one batched engine call draws; a larger burst takes several calls."""
