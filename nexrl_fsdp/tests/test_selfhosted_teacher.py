"""The recipe's ``teacher`` on the ``self-hosted`` backend: a second worker group
(identifier ``teacher``, ``backend.options.teacher_world_size`` ranks) on the student's
workers' API, whose frozen model scores every step's tokens before the advantages
(on-policy distillation); a lost teacher rank is a lost run, healed like a student's."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from nexrl_core.config import ConfigError, TrainConfig, load_config
from nexrl_core.config.components import resolve_options
from nexrl_core.plugins.registry import find_spec
from nexrl_core.testing.rollouts import sampled_group
from nexrl_core.training.backend import BackendLost, BackendSetup
from nexrl_core.training.batch import Batch
from nexrl_engine import Datum, Engine
from nexrl_fsdp.direct_zmq.group_key import ENV_WORKER_KEY, new_group_key
from nexrl_fsdp.selfhosted.backend import SelfHostedBackend

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


@pytest.mark.slow
def test_a_killed_teacher_rank_is_a_lost_run_and_the_restarted_teacher_scores_as_before(distilling: SelfHostedBackend) -> None:
    backend = distilling
    assert backend.teacher_group is not None
    backend.restart()  # the student's weights back at the base model's, as the next update after a restart sees them
    trajectories = sampled_group(backend.chat_model())
    before, _ = recorded_update(backend, trajectories)
    teacher = backend.teacher_group
    assert teacher is not None
    (pid,) = teacher.rank_pids().values()
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while teacher.transport.info()["status"] != "dead":
        assert time.monotonic() < deadline, "the teacher's lost rank was not noticed"
        time.sleep(0.2)
    with pytest.raises(BackendLost, match="worker group 'teacher' is dead"):
        backend.train(trajectories, 1)
    assert backend.restart(), "a lost teacher is restarted like a lost student"
    assert backend.teacher_group is not teacher and list(backend.teacher_group.rank_pids().values()) != [pid]
    after, _ = recorded_update(backend, trajectories)
    for (tokens, mask, advantages), (tokens_before, mask_before, advantages_before) in zip(rows_of(after), rows_of(before)):
        assert (tokens, mask) == (tokens_before, mask_before)
        assert advantages == pytest.approx(advantages_before, abs=1e-5)
    assert len(rows_of(after)) == len(rows_of(before))


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
