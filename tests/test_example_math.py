"""examples/math: the shipped items are what the seeded generator writes, the same in JSON
lines and parquet, every reference answer verifies; the recipe trains end to end on the
tiny model, and ``nexrl eval`` of the run, from another directory, reproduces its last
validation."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from nexrl_core.config import TaskConfig, load_config
from nexrl_core.run.data import resolve_task
from nexrl_math import math_reward

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "math"
NEXRL = str(Path(sys.executable).with_name("nexrl"))


def make_data() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_data", EXAMPLE / "make_data.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_shipped_files_are_what_the_generator_writes(tmp_path: Path) -> None:
    written = make_data().write(tmp_path)
    assert sorted(path.name for path in written) == ["train.jsonl", "train.parquet", "val.jsonl", "val.parquet"]
    for split in ("train", "val"):
        assert (tmp_path / f"{split}.jsonl").read_bytes() == (EXAMPLE / f"{split}.jsonl").read_bytes()
        shipped = resolve_task(TaskConfig(data_path=str(EXAMPLE / f"{split}.parquet"), agent="json:dumps"), seed=0)
        fresh = resolve_task(TaskConfig(data_path=str(tmp_path / f"{split}.parquet"), agent="json:dumps"), seed=0)
        assert fresh.train.take(0, 500) == shipped.train.take(0, 500)


def test_jsonl_and_parquet_hold_the_same_items_and_the_splits_do_not_overlap() -> None:
    config = load_config(EXAMPLE / "recipe.yaml", [])
    task = resolve_task(config.task, config.seed, EXAMPLE)
    as_jsonl = resolve_task(
        TaskConfig(data_path="train.jsonl", val_data_path="val.jsonl", agent=config.task.agent, columns=config.task.columns),
        config.seed,
        EXAMPLE,
    )
    assert task.val_items == as_jsonl.val_items and len(task.val_items) == 80
    assert task.train.take(0, 320) == as_jsonl.train.take(0, 320)
    questions = {json.dumps(item["prompt"]) for item, _ in task.train.take(0, 320)}
    assert len(questions) > 250, "the generator draws varied problems"
    assert not questions & {json.dumps(item["prompt"]) for item, _ in task.val_items}


def test_every_reference_answer_verifies_and_a_wrong_one_does_not() -> None:
    items = [json.loads(line) for line in (EXAMPLE / "val.jsonl").read_text().splitlines()]
    templates = {item["extra_info"]["template"] for item in items}
    assert templates == set(make_data().TEMPLATES)
    for item in items:
        truth = item["reward_model"]["ground_truth"]
        assert math_reward(f"The answer is \\boxed{{{truth}}}", truth) == 1.0, item
        assert math_reward(f"The answer is \\boxed{{{truth}+1}}", truth) == 0.0, item


@pytest.mark.slow
def test_the_recipe_trains_on_the_tiny_model_and_eval_reproduces_its_validation(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    train = subprocess.run(
        [NEXRL, "train", str(EXAMPLE / "recipe.yaml"), f"output.dir={run_dir}", "schedule.steps=2", "schedule.validate_every=2",
         "task.val_size=24", "--no-progress"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert train.returncode == 0, train.stdout + train.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2]
    assert all(0.0 <= row["val/reward/mean"] <= 1.0 for row in (rows[0], rows[2]))
    assert "agent/answered" in rows[1], "the agent's extra metric is logged"

    evaluated = subprocess.run(
        [NEXRL, "eval", str(run_dir), "--out", str(tmp_path / "eval.json")], capture_output=True, text=True, timeout=600, cwd=elsewhere
    )
    assert evaluated.returncode == 0, evaluated.stdout + evaluated.stderr
    report = json.loads((tmp_path / "eval.json").read_text())
    last = {key: value for key, value in rows[-1].items() if key.startswith("val/")}
    assert {key: report["metrics"][key] for key in last} == last
