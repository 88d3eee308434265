"""Worker ranks started by these tests check that each collective of NexRL's own code could
run on a GPU run's process group (nexrl_fsdp.worker.collective_check): CI has no GPU.

Also the runs the worker tests train on, as the workers take them (a `Batch`) and as the
single-process engine they are compared against takes them (datums), and the sampler
process the workers push weights to; the test modules import them with
``from tests.conftest import ...`` as the suite runs from this distribution's folder."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("NEXRL_CHECK_COLLECTIVES", "1")

from nexrl_engine import Datum  # first: nexrl_engine sets its OpenMP wait policy before anything loads torch

# isort: split

import torch

from nexrl_core.training.batch import Batch
from nexrl_core.types import Trajectory
from nexrl_engine.batching import BatchedSamplingOptions
from nexrl_engine.config import EngineConfig
from nexrl_fsdp.selfhosted.sampler_process import SamplerProcess
from nexrl_fsdp.selfhosted.sampler_server import SamplerSettings

ADVANTAGES = [0.7, -1.2, 0.4, 1.5, -0.3]
"""One advantage a run of `training_runs`."""


def training_runs(group_size: int = 1) -> list[Trajectory]:
    """Five runs (odd, so one padding row goes to rank 1) of different lengths and advantages;
    with ``group_size`` > 1, runs come in groups that share a 12-token prompt, as GRPO's do."""
    generator = torch.Generator().manual_seed(0)
    runs = []
    for index in range(5):
        length = 3 + index % 2 if group_size == 1 else 12
        if index % group_size == 0:
            prompt = torch.randint(1, 1000, (length,), generator=generator).tolist()
        response = torch.randint(1, 1000, (2 + index,), generator=generator).tolist()
        logprobs = [0.0] * len(prompt) + (-torch.rand(len(response), generator=generator) * 3).tolist()
        runs.append(
            Trajectory(
                tokens=prompt + response,
                loss_mask=[0] * len(prompt) + [1] * len(response),
                logprobs=logprobs,
                reward=float(index % 2),
                group_id="g",
                run_id=index,
                task_id="t",
            )
        )
    return runs


def training_batch(group_size: int = 1) -> Batch:
    """`training_runs` as the workers train on them, with their `ADVANTAGES`."""
    batch = Batch.from_trajectories(training_runs(group_size), pad_token_id=0)
    batch.tensors["advantages"] = batch.tensors["loss_mask"] * torch.tensor(ADVANTAGES)[:, None]
    return batch


def training_datums(group_size: int = 1) -> list[Datum]:
    """`training_runs` as the engine trains on them, with their `ADVANTAGES`."""
    datums = []
    for trajectory, advantage in zip(training_runs(group_size), ADVANTAGES):
        tokens, mask = trajectory.tokens, trajectory.loss_mask
        datums.append(
            Datum(
                input_tokens=tokens[:-1],
                loss_fn_inputs={
                    "target_tokens": tokens[1:],
                    "logprobs": trajectory.logprobs[1:],
                    "advantages": [advantage * m for m in mask[1:]],
                    "mask": [float(m) for m in mask[1:]],
                },
            )
        )
    return datums


@contextlib.contextmanager
def ready_sampler(log_dir: Path, key: str, **engine: Any) -> Iterator[tuple[SamplerProcess, str]]:
    """A sampler process on nexrl-tiny (seed 0; ``engine`` as more `EngineConfig` fields)
    holding ``key`` (the key of the group that pushes to it), once it serves, with its
    endpoint; stopped on the way out. Its log is ``sampler.log`` in ``log_dir``."""
    settings = SamplerSettings(engine=EngineConfig(model="nexrl-tiny", seed=0, **engine), batching=BatchedSamplingOptions())
    sampler = SamplerProcess(settings, log_dir / "sampler.log", key=key)
    try:
        sampler.wait_ready()
        assert sampler.endpoint is not None
        yield sampler, sampler.endpoint
    finally:
        sampler.stop()
