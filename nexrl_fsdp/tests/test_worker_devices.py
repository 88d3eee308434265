"""Where ranks compute and what their process group carries (`nexrl_fsdp.worker.devices`),
and the CPU-run check that NexRL's collectives would run on a GPU group (`collective_check`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from nexrl_fsdp.worker.devices import ENV_WORKER_DEVICE, carried_device_types, process_group_backend, rank_device


def test_a_gpu_group_carries_host_and_device_tensors() -> None:
    """The group's bookkeeping tensors live in host memory: NCCL alone cannot carry them."""
    assert carried_device_types(process_group_backend("cuda")) == {"cpu", "cuda"}
    assert carried_device_types(process_group_backend("cpu")) >= {"cpu"}
    assert carried_device_types("nccl") == {"cuda"}, "the backend of the first GPU run, which failed at its first command"


def test_the_rank_device_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_WORKER_DEVICE, "cpu")
    assert rank_device(3) == torch.device("cpu"), "cpu is honoured whatever the machine has"
    monkeypatch.setenv(ENV_WORKER_DEVICE, "tpu")
    with pytest.raises(ValueError, match="NEXRL_WORKER_DEVICE='tpu': use cpu or cuda"):
        rank_device(0)
    if not torch.cuda.is_available():
        monkeypatch.setenv(ENV_WORKER_DEVICE, "cuda")
        with pytest.raises(RuntimeError, match="torch sees no CUDA device"):
            rank_device(0)


_CHECKED_RUN = """
import torch, torch.distributed as dist
from nexrl_fsdp.worker import collective_check
assert collective_check.install()
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
from nexrl_fsdp.worker.datum_ops import _broadcast_json
print(_broadcast_json({{"ok": 1}}, 0))
dist.all_reduce(torch.ones(1))  # torch's own or a test's collectives are not NexRL's: unchecked
dist.destroy_process_group()
"""


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_the_collective_check_passes_nexrl_collectives_a_gpu_group_carries() -> None:
    """On a CPU, with the check on, NexRL's own collectives (on host tensors) pass, since a
    GPU group carries host tensors; `test_workers_uneven_shards` runs every op under it,
    and the mutation list shows it failing the whole group at its first command when a
    GPU group is NCCL alone (the first GPU run's bug)."""
    env = {**os.environ, "NEXRL_CHECK_COLLECTIVES": "1"}
    result = subprocess.run(
        [sys.executable, "-c", _CHECKED_RUN.format(port=_free_port())], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and "{'ok': 1}" in result.stdout, result.stderr[-3000:]
