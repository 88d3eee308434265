"""nexrl-fsdp's side of the core's worker-group seam (`nexrl_core.worker_groups`): the
`GroupEngines` that ``nexrl_group_engines`` registers, so a local service with ``--workers N``
trains each model on FSDP ranks without importing this package."""

from __future__ import annotations

from nexrl_core.specs import NoOptions
from nexrl_core.worker_groups import GroupEngineSetup
from nexrl_fsdp.worker_groups import WorkerGroupEngine

__all__ = ["FsdpGroupEngines"]


class FsdpGroupEngines:
    """Starts a `WorkerGroupEngine` for each model a service trains on workers."""

    def __init__(self, options: NoOptions) -> None:
        """:param options: none; the spec's factory is called with its config class."""

    def local_gpus(self) -> int:
        """Every CUDA device torch sees when the ranks compute on GPUs, as each rank decides
        (`nexrl_fsdp.worker.devices.ranks_use_cuda`: ``NEXRL_WORKER_DEVICE=cpu`` keeps them
        on the CPU); else none."""
        import torch

        from nexrl_fsdp.worker.devices import ranks_use_cuda

        return torch.cuda.device_count() if ranks_use_cuda() and torch.cuda.is_available() else 0

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
