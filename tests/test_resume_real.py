"""`nexrl train --resume` after a hard kill gives the same results as never stopping, on
the real path: the quickstart (shortened) on each local backend, the whole job killed
with SIGKILL right after a checkpoint, then resumed by a new process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

NEXRL = str(Path(sys.executable).with_name("nexrl"))
STEPS, CHECKPOINT = 8, 4
EXACT = ("reward/", "advantages/", "rollout/runs", "rollout/trajectories", "datums/", "groups/", "grpo/", "score/")
"""Metrics that must match exactly: what was sampled and how it was scored."""


def command(out_dir: Path, backend: str, *extra: str) -> list[str]:
    overrides = [
        f"output.dir={out_dir}",
        f"schedule.steps={STEPS}",
        f"schedule.checkpoint_every={CHECKPOINT}",
        "schedule.validate_every=1000",
        "task.val_size=8",
    ]
    if backend != "remote_api":
        overrides.append(f"backend.name={backend}")
    return [NEXRL, "train", *overrides, *extra]


def training_rows(out_dir: Path) -> dict[int, dict[str, float]]:
    """The last logged row of each training step."""
    rows: dict[int, dict[str, float]] = {}
    for line in (out_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("step", 0) >= 1 and "reward/mean" in row:
            rows[int(row["step"])] = row
    return rows


def kill_after_checkpoint(out_dir: Path, backend: str) -> None:
    """Run until the step-CHECKPOINT checkpoint is recorded, then SIGKILL the whole job."""
    state = out_dir / "run_state.json"
    process = subprocess.Popen(command(out_dir, backend), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (state.exists() and json.loads(state.read_text() or "{}").get("step") == CHECKPOINT):
            assert process.poll() is None, "the run ended before its checkpoint"
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.05)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=60)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["remote_api", "inprocess", "self-hosted"])
def test_resume_after_a_hard_kill_matches_an_uninterrupted_run(tmp_path: Path, backend: str) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    subprocess.run(command(straight, backend), check=True, capture_output=True, timeout=600)
    kill_after_checkpoint(resumed, backend)
    done = subprocess.run(command(resumed, backend, "--resume"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    expected, got = training_rows(straight), training_rows(resumed)
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1))
    for step in range(CHECKPOINT + 1, STEPS + 1):
        for key, value in expected[step].items():
            if key.startswith(EXACT):
                assert got[step][key] == value, f"step {step} {key}: {got[step][key]} != {value}"
            elif key.startswith("train/"):
                assert got[step][key] == pytest.approx(value, rel=1e-4, abs=1e-4), f"step {step} {key}"
