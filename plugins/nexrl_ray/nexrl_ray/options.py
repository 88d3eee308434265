"""Options of the ``ray`` placer; light to import (no ray)."""

from __future__ import annotations

import attrs

from nexrl_core.config.checks import positive

__all__ = ["STRATEGIES", "RayPlacerOptions"]

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
"""Ray's placement-group strategies: PACK fills as few nodes as it can (NCCL inside a node
is faster than across), SPREAD puts the ranks on as many; STRICT_ refuses to do otherwise."""


@attrs.frozen(kw_only=True)
class RayPlacerOptions:
    """Which Ray cluster, and how a group's ranks are spread over it."""

    address: str | None = None
    """The cluster's address (``HOST:6379``, ``ray://HOST:10001``); None: ``RAY_ADDRESS``,
    else the cluster ``ray start`` runs on this machine. No cluster is ever started here."""
    strategy: str = attrs.field(default="PACK", validator=attrs.validators.in_(STRATEGIES))
    place_timeout_s: float = attrs.field(default=60.0, validator=positive)
    """How long Ray may take to find room for a group before the request is refused
    (a service answers 429) and its placement group removed."""
    resources_per_rank: dict[str, float] = attrs.field(factory=dict)
    """Custom Ray resources each rank needs besides CPUs and GPUs (a node label such as
    ``{"trainer_node": 1}`` keeps ranks on the nodes started with it)."""
