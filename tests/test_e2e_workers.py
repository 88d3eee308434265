"""`nexrl train` with ``backend.options.workers``: the embedded service trains the run's
model on a worker group, and the run is the one the in-process engine gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from nexrl_testing.processes import ListenerWatch

NEXRL = str(Path(sys.executable).with_name("nexrl"))  # the nexrl under test, not whichever is first on PATH
SHORT = [
    "schedule.steps=2",
    "schedule.validate_every=0",
    "schedule.checkpoint_every=0",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
]


def train(out: Path, workers: int, watch: ListenerWatch | None = None) -> list[dict]:
    """The short run; under ``watch``, stopped the moment a process of it listens beyond the loopback."""
    command = [NEXRL, "train", *SHORT, f"backend.options.workers={workers}", f"output.dir={out}", "--no-progress"]
    if watch is None:
        completed = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=out.parent)
    else:
        completed = watch.run(command, env={**os.environ, "NEXRL_E2E_WORKERS": watch.marker}, timeout=600, cwd=out.parent)
        assert watch.beyond_loopback() == [], f"listening beyond the loopback: {watch.beyond_loopback()} (of {sorted(watch.seen)})"
    assert completed.returncode == 0, completed.stdout + completed.stderr
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_the_embedded_service_trains_on_a_worker_group(tmp_path: Path) -> None:
    """The run on a worker group gives the in-process engine's run, and no process of it
    listens beyond the loopback at any time: the service, torchrun, the rank, and the
    `WeightsInbox` the service opens for each weights push from the group (step 2 samples
    from the weights step 1 trained), a socket that lives tens of milliseconds. The
    group's run comes first, so a listener beyond the loopback fails the test at once."""
    with ListenerWatch(uuid.uuid4().hex) as watch:
        on_group = train(tmp_path / "group", 1, watch)
    assert len({pid for pid, _, _ in watch.seen}) >= 2, f"the service and its rank listen: {sorted(watch.seen)}"
    in_process = train(tmp_path / "engine", 0)
    logs = list((tmp_path / "group" / "backend" / "service" / "workers").glob("*.log"))
    assert len(logs) == 1, "the run's model did not train on a group of its own"
    assert not (tmp_path / "engine" / "backend" / "service" / "workers").exists()
    assert [row["step"] for row in on_group] == [1, 2]
    for engine_row, group_row in zip(in_process, on_group):
        assert group_row["reward/mean"] == engine_row["reward/mean"]
        assert group_row["train/loss"] == pytest.approx(engine_row["train/loss"], rel=1e-4, abs=1e-6)


def test_workers_with_a_service_url_is_refused_before_step_1(tmp_path: Path) -> None:
    command = [
        NEXRL,
        "train",
        "backend.options.base_url=http://127.0.0.1:9",
        "backend.options.workers=2",
        f"output.dir={tmp_path / 'run'}",
        "--no-progress",
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert completed.returncode != 0
    assert "backend.options.workers: 2 applies to the embedded service only" in completed.stdout + completed.stderr


@pytest.mark.parametrize(
    "where", [["backend.options.workers=0"], ["backend.options.base_url=http://127.0.0.1:9", "backend.options.workers=0"]]
)
def test_a_placement_without_the_embedded_services_worker_groups_is_refused_before_step_1(tmp_path: Path, where: list[str]) -> None:
    command = [NEXRL, "train", *where, "backend.options.placement=ray", f"output.dir={tmp_path / 'run'}", "--no-progress"]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert completed.returncode != 0
    assert (
        "backend.options.placement: a placer starts the ranks of the embedded service's worker groups"
        in completed.stdout + completed.stderr
    )


@pytest.mark.slow
def test_worker_groups_that_cannot_start_stop_the_run_in_one_line(tmp_path: Path) -> None:
    """Every rank of the service's groups fails as it starts (a device setting it
    refuses): the service starts two groups, refuses the rest with the cause, and the run
    stops within 150 s (half the connect timeout of 300 s) with one line naming the rank's error and its log; nothing is left."""
    import os
    import time
    import uuid

    from nexrl_testing.processes import processes_with

    marker = uuid.uuid4().hex
    out = tmp_path / "run"
    command = [NEXRL, "train", "backend.options.workers=1", "task.val_size=32", f"output.dir={out}", "--no-progress"]
    started = time.monotonic()
    env = {**os.environ, "NEXRL_WORKER_DEVICE": "tpu", "NEXRL_E2E_WORKERS": marker}
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert time.monotonic() - started < 150, "the rank's failure, not the connect timeout (300 s)"
    assert completed.returncode == 1, completed.stdout[-3000:] + completed.stderr[-3000:]
    (line,) = [line for line in completed.stderr.splitlines() if line.startswith("Error:")]
    assert "rank 0 failed: ValueError: NEXRL_WORKER_DEVICE='tpu'" in line and ".log" in line, line
    assert len(list((out / "backend" / "service" / "workers").glob("*.log"))) == 2, "groups were started again and again"
    assert processes_with(marker) == []
