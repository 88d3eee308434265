"""A check, for CPU test runs, that every collective NexRL's worker code issues could run on a GPU group.

CI has no GPU, and on a CPU every tensor is a CPU tensor, which gloo carries: a
collective handed a tensor that a GPU group cannot carry (a CPU tensor under NCCL alone)
passes every CPU test and fails a GPU run at its first command. With
``NEXRL_CHECK_COLLECTIVES=1`` a rank wraps torch.distributed's collectives before it
starts; each call made from NexRL's own code checks that the device types of its
tensors are among those the process group of a GPU run carries
(`devices.process_group_backend` for ``cuda``). NexRL's code makes its bookkeeping
tensors in host memory, so on a GPU they are CPU tensors too; the model's collectives,
which FSDP issues on the rank's device, are torch's and are not checked.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from nexrl_fsdp.worker.devices import carried_device_types, process_group_backend

__all__ = ["ENV_CHECK_COLLECTIVES", "CollectiveDeviceError", "install"]

ENV_CHECK_COLLECTIVES = "NEXRL_CHECK_COLLECTIVES"
_COLLECTIVES = (
    "broadcast",
    "all_reduce",
    "reduce",
    "all_gather",
    "gather",
    "scatter",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all",
)


class CollectiveDeviceError(RuntimeError):
    """A collective got a tensor the process group of a GPU run cannot carry."""


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in _tensors(item)]
    return []


def _checked(name: str, collective: Callable[..., Any], backend: str, carried: frozenset[str]) -> Callable[..., Any]:
    @functools.wraps(collective)
    def call(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith("nexrl"):
            for tensor in _tensors(list(args) + list(kwargs.values())):
                if tensor.device.type not in carried:
                    raise CollectiveDeviceError(
                        f"{caller} calls dist.{name} on a {tensor.device.type} tensor, which a GPU run's process group "
                        f"({backend!r}) cannot carry"
                    )
        return collective(*args, **kwargs)

    return call


def install() -> bool:
    """Wrap the collectives when ``NEXRL_CHECK_COLLECTIVES`` is set; returns whether it did."""
    if os.environ.get(ENV_CHECK_COLLECTIVES, "") in ("", "0"):
        return False
    backend = process_group_backend("cuda")
    carried = carried_device_types(backend)
    for name in _COLLECTIVES:
        setattr(dist, name, _checked(name, getattr(dist, name), backend, carried))
    return True
