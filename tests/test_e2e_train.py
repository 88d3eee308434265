"""`nexrl train` end to end: the embedded Tinker service, the shipped tiny model, real SDK calls.

A shortened quickstart must raise held-out reward, write every output a user is told
about, and leave no service process behind.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

NEXRL = str(Path(sys.executable).with_name("nexrl"))  # the nexrl under test, not whichever is first on PATH


@pytest.mark.slow
def test_shortened_quickstart_raises_validation_reward(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {key: value for key, value in os.environ.items() if key != "TINKER_API_KEY"}
    command = [
        NEXRL,
        "train",
        "schedule.steps=4",
        "schedule.validate_every=4",
        "schedule.checkpoint_every=2",
        "task.val_size=64",
        f"output.dir={out}",
        "--no-progress",
    ]
    completed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert completed.returncode == 0, completed.stdout + completed.stderr

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    validated = {row["step"]: row["val/reward/mean"] for row in rows if "val/reward/mean" in row}
    assert set(validated) == {0, 4}
    assert validated[4] >= validated[0] + 0.15, f"validation reward did not rise: {validated}"
    assert [row["step"] for row in rows if "reward/mean" in row] == [1, 2, 3, 4]
    assert rows[0]["backend/dtype"] == "float32", "the embedded service says what it trains in"
    assert (out / "reward_curve.png").stat().st_size > 0
    assert any((out / "sinks" / "tensorboard").iterdir())
    assert "reward_curve.png" in completed.stdout


@pytest.mark.slow
def test_bf16_trains_on_the_embedded_service(tmp_path: Path) -> None:
    """``model.dtype: bf16`` starts the embedded service in bf16; the service says so."""
    out = tmp_path / "run"
    command = [NEXRL, "train", "model.dtype=bf16", "schedule.steps=1", "schedule.validate_every=0", f"output.dir={out}", "--no-progress"]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["backend/dtype"] == "bfloat16" and row["train/loss"] is not None


@pytest.mark.slow
def test_prompt_and_response_limits_hold_on_the_embedded_service(tmp_path: Path) -> None:
    """The addition prompts are 12 to 14 tokens: ``rollout.max_prompt_tokens=13`` with
    ``skip`` drops the 14-token runs in training and validation (and an error budget of 0
    still holds: they are no failures), and ``rollout.max_response_tokens=2`` cuts every
    two-digit sum's reply, sampled through the embedded Tinker service."""
    out = tmp_path / "run"
    command = [
        NEXRL,
        "train",
        "schedule.steps=1",
        "schedule.validate_every=1",
        "task.val_size=32",
        "rollout.prompts_per_step=8",
        "rollout.group_size=4",
        "rollout.max_prompt_tokens=13",
        "rollout.prompt_overflow=skip",
        "rollout.max_response_tokens=2",
        "rollout.error_budget=0",
        f"output.dir={out}",
        "--no-progress",
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    validation, step = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][:2]
    assert 0 < step["rollout/skipped_runs"] < step["rollout/runs"] and 0 < validation["val/rollout/skipped_runs"] < 32
    assert step["rollout/agent_errors"] == 0 and step["rollout/truncated_fraction"] > 0
    assert step["rollout/response_tokens"] <= 2 * (step["rollout/runs"] - step["rollout/skipped_runs"])


@pytest.mark.slow
def test_an_over_long_prompt_stops_the_run_in_one_line_naming_the_key(tmp_path: Path) -> None:
    """``rollout.prompt_overflow`` left at ``error``: the first 14-token prompt stops the run
    on the embedded Tinker service with one line naming the key, the limit, the prompt's
    length and the task item."""
    command = [
        NEXRL,
        "train",
        "schedule.steps=1",
        "schedule.validate_every=0",
        "rollout.max_prompt_tokens=13",
        f"output.dir={tmp_path / 'run'}",
        "--no-progress",
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert completed.returncode == 1, completed.stdout + completed.stderr
    (line,) = [line for line in completed.stderr.splitlines() if line.startswith("Error: ")]
    assert re.fullmatch(
        r"Error: rollout\.max_prompt_tokens: the prompt of model call 1 of task '\d\d\+\d\d=' \(step 1, run \d\) has 14 tokens, "
        r"over the limit of 13; raise rollout\.max_prompt_tokens, or set rollout\.prompt_overflow to truncate_left "
        r"\(keep the last tokens\) or skip \(drop such runs\)",
        line,
    ), line
    assert "Traceback" not in completed.stderr
