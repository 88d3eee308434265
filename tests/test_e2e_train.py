"""`nexrl train` end to end: the embedded Tinker service, the shipped tiny model, real SDK calls.

A shortened quickstart must raise held-out reward, write every output a user is told
about, and leave no service process behind.
"""

from __future__ import annotations

import json
import os
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
        NEXRL, "train", "schedule.steps=4", "schedule.validate_every=4", "schedule.checkpoint_every=2",
        "task.val_size=64", f"output.dir={out}", "--no-progress",
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
