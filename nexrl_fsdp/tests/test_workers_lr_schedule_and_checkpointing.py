"""The self-hosted path of ``algorithm.lr_schedule``/``warmup_steps`` and
``model.gradient_checkpointing``: the recipe goes through the backend's own checks and
``init_model`` to a real 2-rank worker group, whose optimizer applies each step's
scheduled rate (``actor/lr``) on a model whose layers checkpoint."""

from __future__ import annotations

from collections.abc import Iterator
from importlib.resources import as_file, files
from pathlib import Path

import pytest
import torch

from nexrl_core.config import TrainConfig, load_config
from nexrl_core.config.components import resolve_options
from nexrl_core.config.lr_schedule import scheduled_learning_rate
from nexrl_core.training.backend import BackendSetup
from nexrl_core.types import Trajectory
from nexrl_fsdp.direct_zmq.launch import WorkerGroup
from nexrl_fsdp.selfhosted.backend import _check, _init_workers

pytestmark = pytest.mark.slow

RATES = [scheduled_learning_rate(0.01, step, schedule="cosine", warmup_steps=1, total_steps=3) for step in (1, 2, 3)]


def recipe(tmp_path: Path) -> TrainConfig:
    with as_file(files("nexrl_core").joinpath("recipes", "quickstart.yaml")) as path:
        return load_config(
            path,
            [
                f"output.dir={tmp_path / 'run'}", "backend.name=self-hosted", "backend.options={world_size: 2}",
                "schedule.steps=3", "algorithm.learning_rate=0.01", "algorithm.lr_schedule=cosine", "algorithm.warmup_steps=1",
                "model.gradient_checkpointing=true",
            ],
        )  # fmt: skip


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[WorkerGroup]:
    group = WorkerGroup(
        2,
        tmp_path / "workers.log",
        heartbeat_s=0.5,
        dead_after_s=5,
        op_timeout_s=120,
        extra_env={"NEXRL_WORKER_COLLECTIVE_TIMEOUT_S": "60"},
    )
    try:
        yield group
    finally:
        group.stop()


def group_of_runs() -> list[Trajectory]:
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, 1000, (8,), generator=generator).tolist()
    runs = []
    for index, reward in enumerate((1.0, 0.0, 0.0, 1.0)):
        response = torch.randint(1, 1000, (3 + index,), generator=generator).tolist()
        runs.append(
            Trajectory(
                tokens=prompt + response,
                loss_mask=[0] * len(prompt) + [1] * len(response),
                logprobs=[0.0] * len(prompt) + [-2.0] * len(response),
                reward=reward,
                group_id="g",
                run_id=index,
                task_id="t",
            )
        )
    return runs


def test_the_workers_apply_each_steps_scheduled_rate_with_checkpointed_layers(tmp_path: Path, workers: WorkerGroup) -> None:
    config = recipe(tmp_path)
    setup = BackendSetup(recipe=config, options=resolve_options("backends", config.backend, "backend"), work_dir=tmp_path / "backend")
    trainer = _check(setup, setup.options)
    try:
        _init_workers(setup, trainer, workers.transport)  # type: ignore[arg-type]
        metrics = [trainer.train(group_of_runs(), step) for step in (1, 2, 3)]
    finally:
        trainer.close()
    assert RATES == pytest.approx([0.01, 0.005, 0.0])  # warmup 1/1, then cos(pi/2) and cos(pi) halves
    assert [m["optim/lr"] for m in metrics] == pytest.approx(RATES)
    assert [m["train/actor/lr"] for m in metrics] == pytest.approx(RATES)
    assert all(m["train/actor/gradient_checkpointing"] == 1.0 for m in metrics)
