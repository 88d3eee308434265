"""Values the conversion rules compute from: a number, a service's ranks."""

from __future__ import annotations

from typing import Any

from nexrl_core.v1.convert import Converter
from nexrl_core.v1.table import ABSENT

__all__ = ["number", "ranks"]


def number(converter: Converter, v1: str, value: Any) -> float | None:
    """``value`` as a number, or None after a not-supported line (an environment reference,
    say, which only the run resolves)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    converter.refuse(v1, f"the conversion needs a number here to compute from, got {value!r}", "write the number in the v1 recipe")
    return None


def ranks(converter: Converter, service: str, new: str) -> None:
    """A service's ranks to ``new``: its ``world_size``, or v1.4's pods times GPUs per pod."""
    if converter.kind != "workers":
        return
    flat, pods, gpus = (converter.value(f"{service}.{key}") for key in ("world_size", "resource.world_size", "resource.gpus_per_pod"))
    if pods is not ABSENT or gpus is not ABSENT:
        pods, gpus = (1 if value is ABSENT else value for value in (pods, gpus))
        total = (
            number(converter, f"{service}.resource.world_size", pods),
            number(converter, f"{service}.resource.gpus_per_pod", gpus),
        )
        if None in total:
            return
        count = int(total[0] * total[1])  # type: ignore[operator]
        for key in (f"{service}.resource.world_size", f"{service}.resource.gpus_per_pod"):
            if converter.present(key):
                converter.carry(key, {new: count}, note="pods x GPUs per pod")
        converter.drop(f"{service}.world_size", "v1.4 read the pods and GPUs per pod under resource instead")
    elif flat is not ABSENT:
        converter.carry(f"{service}.world_size", {new: flat})
