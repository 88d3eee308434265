"""The recipe's ``teacher`` on the ``self-hosted`` backend: a second worker group
(identifier ``teacher``, ``backend.options.teacher_world_size`` ranks) on the student's
workers' API, whose frozen model scores every step's tokens before the advantages
(on-policy distillation); a lost teacher rank is a lost run, healed like a student's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from nexrl_core.config import ConfigError, TrainConfig, load_config
from nexrl_core.config.components import resolve_options
from nexrl_core.plugins.registry import find_spec
from nexrl_core.testing.rollouts import sampled_group
from nexrl_core.training.backend import BackendSetup
from nexrl_core.training.batch import Batch
from nexrl_engine import Datum, Engine
from nexrl_fsdp.direct_zmq.group_key import ENV_WORKER_KEY, new_group_key
from nexrl_fsdp.selfhosted.backend import TEACHER_IDENTIFIER, SelfHostedBackend
from nexrl_testing.processes import processes_running, processes_with

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "quickstart_fsdp.yaml"
KL_COEF = 0.5
DISTIL = (
    "algorithm.advantage.name=on_policy_distillation",
    f"algorithm.advantage.options.kl_coef={KL_COEF}",
    "backend.options.teacher_world_size=1",
    "backend.options.heartbeat_s=0.5",
    "backend.options.dead_after_s=3",
)
"""A teacher's group of one rank beside the student's two (rows are padded to each
group's own world size), and a lost rank noticed within seconds."""


def recipe(tmp_path: Path, *overrides: str) -> TrainConfig:
    return load_config(RECIPE, [f"output.dir={tmp_path / 'run'}", *overrides])


def open_backend(config: TrainConfig, work_dir: Path) -> SelfHostedBackend:
    options = resolve_options("backends", config.backend, "backend")
    return find_spec("backends", "self-hosted").open(BackendSetup(recipe=config, options=options, work_dir=work_dir))


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """nexrl-tiny after one large step: a local Hugging Face directory whose log-probs
    differ from the shipped model's, as a run's ``final_model`` would."""
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, 1000, (16,), generator=generator).tolist()
    engine = Engine(model="nexrl-tiny", seed=0)
    inputs = {"target_tokens": tokens[1:], "logprobs": [-1.0] * 15, "advantages": [1.0] * 15, "mask": [1.0] * 15}
    engine.forward_backward([Datum(input_tokens=tokens[:-1], loss_fn_inputs=inputs)], "importance_sampling")
    engine.optim_step(learning_rate=3e-2)
    return engine.export_hf(tmp_path_factory.mktemp("teacher") / "model")


@pytest.fixture(scope="module")
def distilling(tmp_path_factory: pytest.TempPathFactory, teacher_dir: Path) -> Iterator[SelfHostedBackend]:
    directory = tmp_path_factory.mktemp("self-hosted-teacher")
    backend = open_backend(recipe(directory, f"teacher.model={teacher_dir}", *DISTIL), directory / "backend")
    try:
        yield backend
    finally:
        backend.close()
    assert backend.teacher_group is not None and backend.teacher_group.placed is None, "closing the backend ends the teacher's ranks"


def recorded_update(backend: SelfHostedBackend, trajectories: Any) -> tuple[Batch, dict[str, float]]:
    """Train once on ``trajectories``; returns the batch the student's workers got."""
    sent: list[Batch] = []
    update = backend.transport.update_actor
    backend.transport.update_actor = lambda batch, options: sent.append(batch) or update(batch, options)  # type: ignore[method-assign]
    try:
        metrics = backend.train(trajectories, 1)
    finally:
        del backend.transport.update_actor
    (batch,) = sent
    return batch, metrics


def rows_of(batch: Batch) -> list[tuple[list[int], list[float], list[float]]]:
    """Each real row's tokens, loss mask and advantages, padding left out."""
    rows = []
    for row in range(batch.batch_size):
        if batch.tensors["valid_rows"][row]:
            kept = batch.tensors["attention_mask"][row].bool()
            rows.append(
                (
                    batch.tensors["input_ids"][row][kept].tolist(),
                    batch.tensors["loss_mask"][row][kept].tolist(),
                    batch.tensors["advantages"][row][kept].tolist(),
                )
            )
    return rows


@pytest.mark.slow
def test_two_groups_on_one_workers_api_and_the_teachers_scores_are_the_advantage(distilling: SelfHostedBackend, teacher_dir: Path) -> None:
    """Each trained token's advantage is ``-kl_coef * (student - teacher)`` log-prob of
    that token, both computed here by engines of their own: the student's base model
    (the step's old log-probs are recomputed on the student's workers) and the teacher."""
    backend = distilling
    assert backend.group is not None and backend.teacher_group is not None
    assert backend.teacher_group.server is backend.group.server, "one workers' API for both groups"
    registry = backend.group.server.registry
    assert registry is not None
    assert {name: group.world_size for name, group in registry.groups.items()} == {"actor": 2, "teacher": 1}
    batch, metrics = recorded_update(backend, sampled_group(backend.chat_model()))
    assert metrics["teacher/reverse_kl"] != 0
    rows = rows_of(batch)
    student = Engine(model="nexrl-tiny", seed=0).compute_logprobs([tokens for tokens, _, _ in rows])
    teacher = Engine(model=str(teacher_dir), seed=0).compute_logprobs([tokens for tokens, _, _ in rows])
    moved = 0
    for (_, mask, advantages), own, scored in zip(rows, student, teacher):
        for position in range(1, len(mask)):
            expected = -KL_COEF * (own[position] - scored[position]) if mask[position] else 0.0
            assert advantages[position] == pytest.approx(expected, abs=2e-4), position
            moved += abs(expected) > 1e-3
    assert moved, "the teacher disagrees with the student on some sampled token"


def test_teacher_settings_the_workers_cannot_honour_are_refused_before_anything_starts(
    tmp_path: Path, teacher_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refused = {
        "backend.options.teacher_world_size: the recipe sets no teacher.model": ("backend.options.teacher_world_size=1",),
        "teacher.model: cannot load '/no/such/teacher'": ("teacher.model=/no/such/teacher", *DISTIL),
        "teacher.model: the group at backend.options.workers_url was started elsewhere": (
            f"teacher.model={teacher_dir}",
            *DISTIL,
            "backend.options.workers_url=http://127.0.0.1:9",
        ),
    }
    monkeypatch.setenv(ENV_WORKER_KEY, new_group_key())  # a workers_url run needs the group's key first
    for problem, overrides in refused.items():
        with pytest.raises(ConfigError) as error:
            open_backend(recipe(tmp_path, *overrides), tmp_path / "backend")
        assert any(line.startswith(problem) for line in error.value.problems), error.value.problems
        assert not (tmp_path / "backend" / "workers.log").exists(), "no worker may start for a refused recipe"


NEXRL = str(Path(sys.executable).with_name("nexrl"))
STEPS, CHECKPOINT = 4, 2


def distillation_run(out_dir: Path, teacher: Path, marker: str) -> subprocess.Popen[str]:
    """``nexrl train`` of a short self-hosted distillation, its processes carrying ``marker``."""
    command = [
        NEXRL, "train", str(RECIPE), f"output.dir={out_dir}", f"teacher.model={teacher}", *DISTIL,
        f"schedule.steps={STEPS}", f"schedule.checkpoint_every={CHECKPOINT}", "schedule.validate_every=1000", "task.val_size=8",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "backend.options.max_restarts=1", "--no-progress",
    ]  # fmt: skip
    name, _, value = marker.partition("=")
    with (out_dir.parent / f"{out_dir.name}.log").open("w") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True, env={**os.environ, name: value})


def step_rows(out_dir: Path) -> dict[int, dict[str, float]]:
    rows: dict[int, dict[str, float]] = {}
    for line in (out_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("step", 0) >= 1 and "teacher/reverse_kl" in row:
            rows[int(row["step"])] = row
    return rows


@pytest.mark.slow
def test_a_teacher_rank_killed_during_a_run_is_restarted_once_and_every_step_is_the_uninterrupted_runs(
    tmp_path: Path, teacher_dir: Path
) -> None:
    """``nexrl train`` with both groups; the teacher's rank SIGKILLed once the step-2
    checkpoint is recorded: the run restarts once, from that checkpoint, and every step's
    numbers equal an uninterrupted run's."""
    straight = distillation_run(tmp_path / "straight", teacher_dir, f"NEXRL_TEACHER_TEST={uuid.uuid4().hex}")
    assert straight.wait(timeout=600) == 0, (tmp_path / "straight.log").read_text()[-3000:]
    marker = f"NEXRL_TEACHER_TEST={uuid.uuid4().hex}"
    healed = tmp_path / "healed"
    run = distillation_run(healed, teacher_dir, marker)
    try:
        deadline = time.monotonic() + 300
        state = healed / "run_state.json"
        while not (state.exists() and json.loads(state.read_text() or "{}").get("step") == CHECKPOINT):
            assert run.poll() is None and time.monotonic() < deadline, (tmp_path / "healed.log").read_text()[-3000:]
            time.sleep(0.05)
        (rank,) = processes_running(marker, "nexrl_fsdp.worker", argument=TEACHER_IDENTIFIER)
        os.kill(rank, signal.SIGKILL)
        assert run.wait(timeout=600) == 0, (tmp_path / "healed.log").read_text()[-3000:]
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    output = (tmp_path / "healed.log").read_text()
    assert output.count("restart 1:") == 1 and "restart 2:" not in output, output[-3000:]
    assert not processes_with(marker)
    expected, got = step_rows(tmp_path / "straight"), step_rows(healed)
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        for key in ("reward/mean", "teacher/reverse_kl", "data/advantages/mean"):
            assert got[step][key] == pytest.approx(expected[step][key], rel=1e-4, abs=1e-6), f"step {step} {key}"
        assert expected[step]["teacher/reverse_kl"] != 0
