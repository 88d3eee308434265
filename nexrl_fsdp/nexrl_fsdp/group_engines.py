"""nexrl-fsdp's side of the core's worker-group seam (`nexrl_core.training.worker_groups`): the
`GroupEngines` that ``nexrl_group_engines`` registers, so a local service with ``--workers N``
trains each model on FSDP ranks without importing this package."""

from __future__ import annotations

import os

from nexrl_core.plugins.specs import NoOptions
from nexrl_core.training.worker_groups import GroupEngineSetup
from nexrl_fsdp.worker.devices import ENV_WORKER_DEVICE
from nexrl_fsdp.worker_groups import WorkerGroupEngine

__all__ = ["FsdpGroupEngines"]


class FsdpGroupEngines:
    """Starts a `WorkerGroupEngine` for each model a service trains on workers."""

    def __init__(self, options: NoOptions) -> None:
        """:param options: none; the spec's factory is called with its config class."""

    def local_gpus(self) -> int:
        """Every CUDA device torch sees, unless the ranks are told to stay on the CPU
        (``NEXRL_WORKER_DEVICE=cpu``, which `nexrl_fsdp.worker.devices` honours on each rank)."""
        import torch

        if os.environ.get(ENV_WORKER_DEVICE, "").strip().lower() == "cpu" or not torch.cuda.is_available():
            return 0
        return torch.cuda.device_count()

    def start(self, setup: GroupEngineSetup) -> WorkerGroupEngine:
        return WorkerGroupEngine(
            setup.model_id,
            setup.training,
            setup.dtype,
            setup.settings,
            setup.base_sampler,
            setup.hooks,
            gpus=setup.gpus,
            max_tokens_per_microbatch=setup.max_tokens_per_microbatch,
        )
