"""The recipe's ``teacher`` on the ``inprocess`` backend: a second, frozen engine that
scores the student's sampled tokens before the advantage step (on-policy distillation)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from nexrl_core.config import ConfigError, load_config
from nexrl_core.run.loop import run_training
from nexrl_core.types import Trajectory
from nexrl_engine.engine import Engine
from nexrl_engine.inprocess.holder import EngineHolder

from tests.conftest import group_datums, open_backend, quickstart

DISTIL = ("algorithm.advantage.name=on_policy_distillation", "algorithm.advantage.options.kl_coef=0.5")


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """nexrl-tiny after one large step: a local Hugging Face directory whose log-probs
    differ from the shipped model's, as a run's ``final_model`` would."""
    engine = Engine(model="nexrl-tiny", seed=0)
    engine.forward_backward(group_datums(), "importance_sampling")
    engine.optim_step(learning_rate=3e-2)
    return engine.export_hf(tmp_path_factory.mktemp("teacher") / "model")


def test_the_teacher_scores_tokens_as_its_own_frozen_model(tmp_path: Path, teacher_dir: Path) -> None:
    backend = open_backend(quickstart(tmp_path, f"teacher.model={teacher_dir}", *DISTIL), tmp_path / "backend")
    try:
        holder = backend.holder
        sequences = [datum.input_tokens + datum.loss_fn_inputs["target_tokens"][-1:] for datum in group_datums()]
        scored = holder.teacher_logprobs(sequences)  # type: ignore[attr-defined]
        expected = Engine(model=str(teacher_dir), seed=0).compute_logprobs(sequences)
        for row, want in zip(scored, expected):
            assert row[0] == 0.0 and len(row) == len(want)
            torch.testing.assert_close(torch.tensor(row[1:]), torch.tensor(want[1:]), rtol=0, atol=1e-5)
        assert scored != holder.reference_logprobs(sequences), "the teacher is its own model, not the student's base"
        assert not any(parameter.requires_grad for parameter in holder._teacher.model.parameters())  # type: ignore[attr-defined]
    finally:
        backend.close()


def test_a_distillation_step_trains_on_minus_coef_times_the_log_ratio_to_the_teacher(
    tmp_path: Path, teacher_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each datum's advantage on a trained target token is ``-0.5 * (sampler logprob -
    teacher logprob of that token)``, the teacher's log-prob of the same position."""
    received: list = []
    train = EngineHolder.train
    monkeypatch.setattr(EngineHolder, "train", lambda self, datums, config: received.extend(datums) or train(self, datums, config))
    settings = ("schedule.steps=1", "schedule.validate_every=0", "rollout.prompts_per_step=2", "rollout.group_size=2")
    run_training(quickstart(tmp_path, f"teacher.model={teacher_dir}", *settings, *DISTIL), progress_bar=False)
    (row,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert row["train/grad_norm"] > 0 and row["teacher/reverse_kl"] > 0
    teacher = Engine(model=str(teacher_dir), seed=0)
    assert len(received) == 4
    for datum in received:
        scores = teacher.compute_logprobs([list(datum.input_tokens) + [datum.target_tokens[-1]]])[0][1:]
        for advantage, sampled, scored, trained in zip(datum.advantages, datum.sampling_logprobs, scores, datum.loss_mask):
            expected = -0.5 * (sampled - scored) if trained else 0.0
            assert advantage == pytest.approx(expected, abs=1e-4)


def _trajectories(holder: EngineHolder) -> list[Trajectory]:
    """Eight runs of different lengths over two prompts, with the student's own log-probs
    as the sampler's, so the reverse KL to the teacher is what it would be on-policy."""
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 1000, (length,), generator=generator).tolist() for length in (6, 9)]
    rows = []
    for run in range(8):
        prompt = prompts[run % 2]
        rows.append(prompt + torch.randint(3, 1000, (2 + run,), generator=generator).tolist())
    student = holder.reference_logprobs(rows)
    return [
        Trajectory(
            tokens=tokens,
            loss_mask=[0] * len(prompts[run % 2]) + [1] * (len(tokens) - len(prompts[run % 2])),
            logprobs=[value if index >= len(prompts[run % 2]) else 0.0 for index, value in enumerate(logprobs)],
            reward=float(run % 3 == 0),
            group_id=f"g{run % 2}",
            run_id=run,
            task_id="t",
        )
        for run, (tokens, logprobs) in enumerate(zip(rows, student))
    ]


def test_a_distillation_step_is_the_same_however_the_engine_splits_it(tmp_path: Path, teacher_dir: Path) -> None:
    """The teacher scores the whole step before the advantages, so a step the engine runs
    in many micro-batches (and without shared prefixes) has the loss and gradient of the
    step in one pass."""
    steps = []
    for limit, share in ((16384, "true"), (40, "false")):
        split = (f"backend.options.max_tokens_per_microbatch={limit}", f"backend.options.share_prefixes={share}")
        config = quickstart(tmp_path, f"teacher.model={teacher_dir}", *DISTIL, "algorithm.advantage.options.kl_discount=0.5", *split)
        backend = open_backend(config, tmp_path / f"backend_{limit}")
        try:
            metrics = backend.train(_trajectories(backend.holder), step=1)  # type: ignore[arg-type]
            assert metrics["datums/trained"] == 8 and metrics["teacher/reverse_kl"] != 0
            steps.append(metrics)
        finally:
            backend.close()
    one_pass, many_passes = steps
    for key in ("teacher/reverse_kl", "advantages/mean", "advantages/std", "train/loss", "train/grad_norm"):
        assert many_passes[key] == pytest.approx(one_pass[key], rel=1e-5, abs=1e-7), key


def test_a_teacher_that_cannot_load_is_refused_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="teacher.model: cannot load '/no/such/teacher'"):
        open_backend(quickstart(tmp_path, "teacher.model=/no/such/teacher", *DISTIL), tmp_path / "backend")


def test_a_teacher_with_another_tokenizer_is_refused_naming_the_key(tmp_path: Path, teacher_dir: Path) -> None:
    """The teacher scores the student's token ids, so one more token in its vocabulary is enough to refuse it."""
    from transformers import AutoTokenizer

    other = tmp_path / "other_tokenizer"
    shutil.copytree(teacher_dir, other)
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["<teacher_only>"])
    tokenizer.save_pretrained(other)
    with pytest.raises(ConfigError, match=f"teacher.model: '{other}' has another tokenizer than model.name 'nexrl-tiny'"):
        open_backend(quickstart(tmp_path, f"teacher.model={other}", *DISTIL), tmp_path / "backend")


@pytest.mark.slow
def test_the_distillation_quickstart_raises_the_students_held_out_reward(tmp_path: Path) -> None:
    """recipes/quickstart_distill.yaml, shortened: a teacher trained by the in-process
    quickstart, then 10 distillation steps of the untrained student, which never sees the
    task's reward, lift its held-out reward and bring it closer to the teacher."""
    recipes = Path(__file__).resolve().parents[3] / "recipes"
    teacher = load_config(recipes / "quickstart_inprocess.yaml", [f"output.dir={tmp_path / 'teacher'}", "schedule.validate_every=0"])
    run_training(teacher, progress_bar=False)
    student = load_config(
        recipes / "quickstart_distill.yaml",
        [f"output.dir={tmp_path / 'student'}", f"teacher.model={tmp_path / 'teacher' / 'final_model'}", "schedule.steps=10"],
    )
    run_training(student, progress_bar=False)
    rows = [json.loads(line) for line in (tmp_path / "student" / "metrics.jsonl").read_text().splitlines()]
    validation = {row["step"]: row["val/reward/mean"] for row in rows if "val/reward/mean" in row}
    assert validation[10] > validation[0] + 0.2, validation
    kl = [row["teacher/reverse_kl"] for row in rows if "teacher/reverse_kl" in row]
    assert kl[-1] < kl[0] / 2, kl
