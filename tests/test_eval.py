"""``nexrl eval``: pass@k, the report, the command's refusals, and, end to end, the same
numbers as the run's own validation for the same model and seed.

The slow tests train a shortened quickstart (on the embedded Tinker service, and
in-process) and evaluate its final model, its last checkpoint and the base model: each
reproduces the validation row the run logged for those weights.
"""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
from importlib.resources import as_file, files
from pathlib import Path
from typing import Any

import pytest

from nexrl_core.commands.eval import choose_model, default_report_path, find_target
from nexrl_core.config import load_config
from nexrl_core.run.evaluation import build_report, pass_at_k, pass_at_k_sizes
from nexrl_core.run.loop import run_training
from nexrl_core.run.rollout import RolloutBatch, RunResult
from nexrl_core.run.validation import Validation

NEXRL = str(Path(sys.executable).with_name("nexrl"))


# --- pass@k and the report ------------------------------------------------------------------------


def brute_force_pass_at_k(outcomes: list[bool], k: int) -> float:
    """The fraction of all k-subsets of the samples that hold a pass."""
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(subset) for subset in subsets) / len(subsets)


def test_pass_at_k_is_the_fraction_of_k_subsets_holding_a_pass() -> None:
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(5, 0, 5) == 0.0 and pass_at_k(3, 3, 1) == 1.0 and pass_at_k(6, 4, 3) == 1.0
    rng = random.Random(7)
    for _ in range(50):
        samples = rng.randint(1, 9)
        outcomes = [rng.random() < 0.4 for _ in range(samples)]
        k = rng.randint(1, samples)
        assert pass_at_k(samples, sum(outcomes), k) == pytest.approx(brute_force_pass_at_k(outcomes, k))
    with pytest.raises(ValueError, match="0 < k <= samples"):
        pass_at_k(3, 1, 4)


def test_pass_at_k_is_reported_for_powers_of_two_and_the_sample_count() -> None:
    assert pass_at_k_sizes(1) == [1]
    assert pass_at_k_sizes(4) == [1, 2, 4]
    assert pass_at_k_sizes(6) == [1, 2, 4, 6]


def run(item: int, sample: int, reward: float | None, tokens: int) -> RunResult:
    return RunResult(
        step=0, item_index=item, run_id=sample, group_id=f"val-p{item}", task_id=f"t{item}", is_val=True,
        reward=reward, response_tokens=tokens if reward is not None else 0,
        error=None if reward is not None else "ValueError: boom",
    )  # fmt: skip


def test_the_report_groups_samples_by_item_and_counts_a_failed_sample_as_not_passing() -> None:
    runs = [run(0, 0, 1.0, 4), run(0, 1, 0.0, 6), run(1, 0, None, 0), run(1, 1, 0.5, 2)]
    validation = Validation(batch=RolloutBatch(step=0, runs=runs), items=2, samples=2, seconds=3.0)
    report = build_report(validation, model="m", recipe="r", temperature=1.0, seed=0, pass_reward=0.5)
    assert [item.task_id for item in report.per_item] == ["t0", "t1"]
    assert report.per_item[1].rewards == [None, 0.5]
    assert report.reward_mean == pytest.approx(0.5)  # the three samples that did not fail
    assert report.pass_at_k == {"pass@1": pytest.approx(0.5), "pass@2": pytest.approx(1.0)}
    assert report.response_tokens_per_sample == pytest.approx(3.0) and report.seconds_per_item == pytest.approx(1.5)
    assert report.agent_errors == 1 and report.metrics["val/count"] == 4.0
    strict = build_report(validation, model="m", recipe="r", temperature=1.0, seed=0, pass_reward=1.0)
    assert strict.pass_at_k == {"pass@1": pytest.approx(0.25), "pass@2": pytest.approx(0.5)}


# --- the command's choices and refusals ---------------------------------------------------------


def test_the_model_and_the_report_path_follow_the_command_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "final_model").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("model: {name: nexrl-tiny}\noutput: {dir: elsewhere}\n")
    (run_dir / "recipe_dir.txt").write_text(f"{tmp_path / 'recipes'}\n")
    target = find_target(run_dir)
    assert (target.recipe, target.recipe_dir) == (run_dir / "config.yaml", tmp_path / "recipes")
    config = load_config(target.recipe, [])
    final = choose_model(target, config, None, None)
    assert final.model_dir == str((run_dir / "final_model").resolve()) and final.checkpoint is None
    assert default_report_path(target, config, final, None, 1) == run_dir / "eval" / "final_model.json"
    assert default_report_path(target, config, final, "sets/hard.jsonl", 8) == run_dir / "eval" / "final_model-hard-samples8.json"
    named = choose_model(target, config, "nexrl-tiny", None)
    assert (named.model_dir, named.label) == ("nexrl-tiny", "model-nexrl-tiny")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model: {name: nexrl-tiny}\noutput: {dir: runs/mine}\n")
    base_target = find_target(recipe)
    base = choose_model(base_target, load_config(recipe, []), None, None)
    assert (base.model_dir, base.description) == (None, "base model nexrl-tiny")
    assert default_report_path(base_target, load_config(recipe, []), base, None, 1) == Path("runs/mine/eval/base.json")


# --- the command's refusals -----------------------------------------------------------------------


def nexrl_eval(*arguments: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([NEXRL, "eval", *arguments], capture_output=True, text=True, timeout=300, cwd=cwd)


def test_bad_targets_are_refused_with_what_to_do(tmp_path: Path) -> None:
    (tmp_path / "not_a_run").mkdir()
    recipe = tmp_path / "recipe.yaml"
    (tmp_path / "train.jsonl").write_text('{"a": 1, "b": 2}\n')
    recipe.write_text("task: {data_path: train.jsonl, agent: 'json:dumps'}\nbackend: {name: inprocess}\nmodel: {name: nexrl-tiny}\n")
    cases = [
        (["missing.yaml"], 1, "missing.yaml does not exist; pass a recipe (YAML) or the output.dir"),
        (["not_a_run"], 1, "not_a_run is a directory but not a run: it has no config.yaml"),
        ([str(recipe), "--step", "3"], 1, "--step picks a checkpoint of a run"),
        ([str(recipe), "--step", "3", "--model", "x"], 2, "--model and --step each name the model"),
        ([str(recipe)], 2, "task: no held-out items to evaluate on"),
        ([str(recipe), "--data", "missing.jsonl"], 2, "task.val_data_path: cannot read 'missing.jsonl'"),
        ([str(recipe), "--samples", "0"], 2, "--samples"),
        ([str(recipe), "--teacher"], 1, "--teacher scores the recipe's teacher.model, and the recipe sets none"),
    ]
    for arguments, status, message in cases:
        done = nexrl_eval(*arguments, cwd=tmp_path)
        assert (done.returncode, message in done.stderr) == (status, True), (arguments, done.stdout + done.stderr)
        assert "Traceback" not in done.stderr


# --- the same numbers as the run's validation --------------------------------------------------------


STEPS = 3
HELD_OUT = 32


def train_short_quickstart(out_dir: Path, backend: str) -> list[dict[str, Any]]:
    overrides = [
        f"output.dir={out_dir}",
        f"schedule.steps={STEPS}",
        f"schedule.validate_every={STEPS}",
        f"schedule.checkpoint_every={STEPS}",
        f"task.val_size={HELD_OUT}",
        "rollout.prompts_per_step=8",
        "rollout.group_size=4",
        "algorithm.learning_rate=1e-3",  # so the final weights validate differently from the base model
        "rollout.val_temperature=0.7",
        "seed=5",
    ]
    if backend != "remote_api":
        overrides += [f"backend.name={backend}", "backend.options={}"]
    with as_file(files("nexrl_core").joinpath("recipes", "quickstart.yaml")) as path:
        run_training(load_config(path, overrides), progress_bar=False)
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def validation_of(row: dict[str, Any]) -> dict[str, float]:
    return {key: value for key, value in row.items() if key.startswith("val/")}


def eval_report(run_dir: Path, name: str, *arguments: str) -> dict[str, Any]:
    out = run_dir / "eval-test" / f"{name}.json"
    done = nexrl_eval(str(run_dir), *arguments, "--out", str(out), cwd=run_dir.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "mean reward" in done.stdout and f"report: {out}" in done.stdout
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "base_model_too"), [("remote_api", False), ("inprocess", True)], ids=["remote_api", "inprocess"])
def test_eval_reproduces_the_runs_validation_for_the_same_weights(tmp_path: Path, backend: str, base_model_too: bool) -> None:
    """The final model and a checkpoint on both backends; the base model (``--model``,
    ``--samples``) on one, since which model an evaluation loads is the backend's own
    affair (each eval on the remote-API backend starts a service of its own)."""
    run_dir = tmp_path / "run"
    rows = train_short_quickstart(run_dir, backend)
    first, last = validation_of(rows[0]), validation_of(rows[-1])
    assert rows[0]["step"] == 0 and rows[-1]["step"] == STEPS
    assert first["val/reward/mean"] != last["val/reward/mean"], "the weights must have moved for the test to mean anything"

    final = eval_report(run_dir, "final")
    assert final["model"] == str((run_dir / "final_model").resolve())
    assert {key: final["metrics"][key] for key in last} == last
    assert final["reward_mean"] == last["val/reward/mean"] == final["pass_at_k"]["pass@1"]
    assert (final["items"], final["seed"], final["temperature"]) == (HELD_OUT, 5, 0.7)

    if base_model_too:
        base = eval_report(run_dir, "base", "--model", "nexrl-tiny")
        assert {key: base["metrics"][key] for key in first} == first

        several = eval_report(run_dir, "base-3", "--model", "nexrl-tiny", "--samples", "3")
        assert [item["rewards"][0] for item in several["per_item"]] == [item["rewards"][0] for item in base["per_item"]]
        assert set(several["pass_at_k"]) == {"pass@1", "pass@2", "pass@3"}
        assert several["pass_at_k"]["pass@3"] >= several["pass_at_k"]["pass@1"]

        distil = ["teacher.model=nexrl-tiny", "algorithm.advantage.name=on_policy_distillation"]
        out = run_dir / "eval-test" / "side.json"
        done = nexrl_eval(str(run_dir), *distil, "--teacher", "--out", str(out), cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        beside = json.loads(out.read_text()), json.loads(out.with_name("side-teacher.json").read_text())
        scored = [{key: report["metrics"][key] for key in first} for report in beside]
        assert scored == [last, first], "the student (the run's final model) and its teacher (the base model), each as alone"
        (line,) = [line for line in done.stdout.splitlines() if "mean reward" in line]
        assert [f"{report['reward_mean']:.4f}" in line for report in beside] == [True, True], "side by side in one table"

    checkpoint = eval_report(run_dir, "checkpoint", "--step", str(STEPS))
    assert {key: checkpoint["metrics"][key] for key in last} == last
