"""Where a rank computes, and which process group backends carry its collectives.

A rank trains on its own GPU (``LOCAL_RANK``) when CUDA is there, on the CPU otherwise;
``NEXRL_WORKER_DEVICE`` (``cpu`` or ``cuda``) overrides the choice. The model's
collectives (FSDP's all-gathers and reduce-scatters, the weights gathered for a sampler)
run on the rank's device; the group's own bookkeeping (an op's header, a batch scattered
by rows, error texts, metric sums) lives in host memory, where it came from and where it
goes back to. So a GPU group is ``cpu:gloo,cuda:nccl``: NCCL for CUDA tensors, gloo for
CPU tensors, each collective going to the backend of its tensors' device. NCCL alone
carries no CPU tensor ("No backend type associated with device type cpu").
"""

from __future__ import annotations

import os

import torch

__all__ = ["ENV_WORKER_DEVICE", "carried_device_types", "process_group_backend", "rank_device"]

ENV_WORKER_DEVICE = "NEXRL_WORKER_DEVICE"
"""``cpu`` or ``cuda``: the ranks' device; unset: CUDA where available."""

_BACKEND_DEVICES = {"gloo": frozenset({"cpu", "cuda"}), "nccl": frozenset({"cuda"})}
"""What a bare backend name carries (torch maps ``gloo`` to CPU and CUDA, ``nccl`` to CUDA)."""


def process_group_backend(device_type: str) -> str:
    """The ``init_process_group`` backend of a group whose ranks compute on ``device_type``."""
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def carried_device_types(backend: str) -> frozenset[str]:
    """The device types whose tensors a group of ``backend`` can hand to a collective."""
    if ":" not in backend:
        return _BACKEND_DEVICES.get(backend, frozenset())
    return frozenset(pair.split(":", 1)[0].strip() for pair in backend.split(","))


def rank_device(local_rank: int) -> torch.device:
    """This rank's device: GPU ``local_rank`` under CUDA (refused by name when the machine
    has fewer GPUs than local ranks), else the CPU."""
    wanted = os.environ.get(ENV_WORKER_DEVICE, "").strip().lower()
    if wanted not in ("", "cpu", "cuda"):
        raise ValueError(f"{ENV_WORKER_DEVICE}={wanted!r}: use cpu or cuda (or leave it unset for CUDA where available)")
    if wanted == "cpu" or (wanted == "" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"{ENV_WORKER_DEVICE}=cuda but torch sees no CUDA device on this machine (torch {torch.__version__})")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise RuntimeError(
            f"local rank {local_rank} needs GPU {local_rank}, but this machine shows {count} "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); start at most {count} ranks per machine"
        )
    return torch.device("cuda", local_rank)
