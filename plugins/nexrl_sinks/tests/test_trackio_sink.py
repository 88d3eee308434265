"""The shortened quickstart reporting to Trackio, run with ``nexrl train`` and read back with
Trackio's own API; ``--resume`` continues the same Trackio run.

Trackio fixes its storage folder (``TRACKIO_DIR``) when it is imported, so the run and
the reading each happen in a process of their own with ``TRACKIO_DIR`` set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

NEXRL = str(Path(sys.executable).with_name("nexrl"))
SINKS = [{"name": "trackio", "options": {"project": "sinks-test", "run_name": "short-quickstart", "group": "grpo"}}]
READ_BACK = """
import json, sys
import trackio
from trackio.sqlite_storage import SQLiteStorage

project, name = sys.argv[1], sys.argv[2]
runs = list(trackio.Api().runs(project))
manifest = SQLiteStorage.get_artifact_manifest(project, "final_model", None) or {}
print(json.dumps({
    "runs": [run.name for run in runs],
    "config": runs[0].config,
    "logs": SQLiteStorage.get_logs(project, name),
    "final_model": {
        "files": sorted(entry["path"] for entry in manifest.get("manifest", [])),
        "type": manifest.get("type"),
        "run": manifest.get("producer_run_name"),
    },
}, default=str))
"""


def train(out_dir: Path, env: dict[str, str], *extra: str) -> None:
    command = [
        NEXRL, "train", f"output.dir={out_dir}", "schedule.steps=2", "schedule.checkpoint_every=1", "schedule.validate_every=2",
        "task.val_size=4", "rollout.prompts_per_step=4", "rollout.group_size=4", f"output.sinks={json.dumps(SINKS)}",
        "--no-progress", *extra,
    ]  # fmt: skip
    completed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, cwd=out_dir.parent)
    assert completed.returncode == 0, completed.stdout + completed.stderr


def read_back(env: dict[str, str]) -> dict[str, Any]:
    completed = subprocess.run(
        [sys.executable, "-c", READ_BACK, "sinks-test", "short-quickstart"], capture_output=True, text=True, env=env, timeout=300
    )
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout.strip().splitlines()[-1])


def test_trackio_holds_every_step_the_recipe_and_the_final_model_and_resume_continues_the_run(tmp_path: Path) -> None:
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio")}
    out_dir = tmp_path / "run"
    train(out_dir, env)
    train(out_dir, env, "schedule.steps=3", "--resume")

    tracked = read_back(env)
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert tracked["runs"] == ["short-quickstart"], "the resumed run is the same Trackio run"
    logged = {entry["step"]: entry for entry in tracked["logs"]}
    assert sorted(logged) == [row["step"] for row in rows] == [0, 1, 2, 3]
    assert len(tracked["logs"]) == 4, "each step once"
    for row in rows:
        for key in ("reward/mean", "train/loss", "val/reward/mean"):
            if row.get(key) is not None:
                assert logged[row["step"]][key] == row[key], (row["step"], key)
    config = {key: value for key, value in tracked["config"].items() if not key.startswith("_")}
    assert config["output"]["sinks"] == SINKS and config["task"]["name"] == "addition"
    assert tracked["config"]["_Group"] == "grpo"
    final_model = tracked["final_model"]
    assert final_model["files"] == sorted(path.name for path in (out_dir / "final_model").iterdir())
    assert (final_model["type"], final_model["run"]) == ("model", "short-quickstart")


RESEND = """
import json, sys
from importlib.resources import as_file, files
from pathlib import Path

from nexrl_core.config import load_config
from nexrl_core.run.sinks import RunOutcome, SinkSetup
from nexrl_sinks.trackio_sink import TrackioOptions, TrackioSink
from trackio.sqlite_storage import SQLiteStorage

out_dir = Path(sys.argv[1])
with as_file(files("nexrl_core").joinpath("recipes", "quickstart.yaml")) as path:
    recipe = load_config(path, [f"output.dir={out_dir}"])
work_dir = out_dir / "sinks" / "trackio"
work_dir.mkdir(parents=True)


def open_sink(resumed_from):
    options = TrackioOptions(project="sinks-test", run_name="resent")
    return TrackioSink(SinkSetup(recipe=recipe, options=options, output_dir=out_dir, work_dir=work_dir, resumed_from=resumed_from))


sink = open_sink(None)
for step in (1, 2, 3):
    sink.log({"step": step, "reward/mean": step / 10})
sink.close(RunOutcome.INTERRUPTED)
sink = open_sink(1)
for step in (2, 3, 4):
    sink.log({"step": step, "reward/mean": step / 100})
sink.close(RunOutcome.FINISHED)
print("logged:", json.dumps([[log["step"], log["reward/mean"]] for log in SQLiteStorage.get_logs("sinks-test", "resent")]))
"""


def test_a_resumed_trackio_run_gets_no_step_twice(tmp_path: Path) -> None:
    """The interrupted process sent steps 1-3 and its last checkpoint was step 1: the
    resumed process sends 2 and 3 again. Trackio stores each log as a new row, so only
    the sink can keep a step from being recorded twice (the tracker keeps the first)."""
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio")}
    completed = subprocess.run([sys.executable, "-c", RESEND, str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=300)
    assert completed.returncode == 0, completed.stderr
    (line,) = [line for line in completed.stdout.splitlines() if line.startswith("logged: ")]
    logged = json.loads(line.removeprefix("logged: "))
    assert logged == [[1, 0.1], [2, 0.2], [3, 0.3], [4, 0.04]]
