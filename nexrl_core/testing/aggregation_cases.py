"""Every registered policy loss under every aggregation mode its config offers.

The split-invariance tests of each training path (the engine's micro-batches, the
workers' ranks and micro-batches, the services) run over this table, so a loss or an
aggregation mode added by any plugin is covered without adding a case anywhere.
"""

from __future__ import annotations

import enum
import typing
from typing import Any

import attrs

from nexrl_core.plugins.registry import get_registry

__all__ = ["AGGREGATION_FIELD", "ENTROPY_FIELD", "loss_aggregation_cases", "with_entropy_bonus"]

AGGREGATION_FIELD = "agg_mode"
"""The loss config field that picks how per-token losses are reduced."""
ENTROPY_FIELD = "entropy_coeff"
"""The loss config field of an entropy bonus, aggregated like the loss."""


def _aggregation_values(config_class: type) -> list[str] | None:
    """The values of the config's aggregation field (an enum), or None without one."""
    if not attrs.has(config_class) or AGGREGATION_FIELD not in attrs.fields_dict(config_class):
        return None
    kind = typing.get_type_hints(config_class).get(AGGREGATION_FIELD)
    if not (isinstance(kind, type) and issubclass(kind, enum.Enum)):
        raise TypeError(
            f"{config_class.__name__}.{AGGREGATION_FIELD} must be annotated with an Enum of the modes, "
            f"got {kind!r}, so that tests can enumerate them"
        )
    return [str(member.value) for member in kind]


def loss_aggregation_cases() -> list[tuple[str, dict[str, Any]]]:
    """``(loss name, loss options)`` for every registered policy loss and each value of
    its aggregation field (one case with no options for a loss without one)."""
    registry = get_registry()
    cases: list[tuple[str, dict[str, Any]]] = []
    for name in registry.names("policy_losses"):
        values = _aggregation_values(registry.find_spec("policy_losses", name).config_class)
        cases.extend([(name, {})] if values is None else [(name, {AGGREGATION_FIELD: value}) for value in values])
    return cases


def with_entropy_bonus(loss: str, options: dict[str, Any], coeff: float = 0.1) -> dict[str, Any]:
    """``options`` plus an entropy bonus where the loss has one, so that a test of the
    loss's aggregation checks the entropy term's too."""
    config_class = get_registry().find_spec("policy_losses", loss).config_class
    has_bonus = attrs.has(config_class) and ENTROPY_FIELD in attrs.fields_dict(config_class)
    return {**options, ENTROPY_FIELD: coeff} if has_bonus else dict(options)
