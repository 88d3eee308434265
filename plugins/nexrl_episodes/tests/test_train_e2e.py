"""`nexrl train` with rollouts from the episode server: worker processes, the real openai client, real HTTP.

Shortened quickstarts must raise held-out reward on the default (remote_api) and the
inprocess backend; under SIGKILLed clients every registered episode still ends exactly
once; a SIGKILLed trainer resumes without losing an ended episode's result.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from nexrl_testing.processes import ListenerWatch

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "quickstart_episodes.yaml"
WORKER = ROOT / "examples" / "episodes" / "addition_worker.py"
NEXRL = str(Path(sys.executable).with_name("nexrl"))  # the nexrl under test, not whichever is first on PATH
SHORT = ["schedule.steps=4", "schedule.validate_every=4", "task.val_size=64", "--no-progress"]


def train(out: Path, *overrides: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess[str], ListenerWatch]:
    """The run under a `ListenerWatch`, which ends it the moment a process of it listens
    beyond the loopback: no process of the run (the trainer with its episode server and
    embedded service, the worker processes) ever listens beyond 127.0.0.1 and ::1."""
    command = [NEXRL, "train", str(RECIPE), f"output.dir={out}", f"rollout.source.options.local_workers.script={WORKER}", *overrides]
    with ListenerWatch(marker := uuid.uuid4().hex) as watch:
        completed = watch.run(command, env={**os.environ, "NEXRL_EPISODES_E2E": marker}, timeout=timeout, cwd=out.parent)
    assert watch.beyond_loopback() == [], f"listening beyond the loopback: {watch.beyond_loopback()} (of {sorted(watch.seen)})"
    return completed, watch


def validation(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["val/reward/mean"] for row in rows if "val/reward/mean" in row}


def episode_rows(out: Path) -> list[tuple[str, str, int, float | None, int]]:
    with sqlite3.connect(out / "rollout" / "episodes.db", timeout=10) as db:
        return db.execute("SELECT episode_id, status, end_calls, reward, step FROM episodes").fetchall()


@pytest.mark.slow
@pytest.mark.parametrize("backend", [[], ["backend.name=inprocess", "backend.options={}"]], ids=["remote_api", "inprocess"])
def test_the_episodes_quickstart_raises_held_out_reward(tmp_path: Path, backend: list[str]) -> None:
    out = tmp_path / "run"
    completed, watch = train(out, *SHORT, *backend)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    server_port = int(json.loads((out / "rollout" / "episode_server.json").read_text())["base_url"].rsplit(":", 1)[1])
    assert server_port in {port for _, _, port in watch.seen}, "the watch saw the episode server"
    validated = validation(out)
    assert set(validated) == {0, 4}
    assert validated[4] >= validated[0] + 0.15, f"validation reward did not rise: {validated}"
    rows = episode_rows(out)
    assert len(rows) == 4 * 128 + 2 * 64  # every run of every step and validation was an episode ...
    assert {(status, end_calls) for _, status, end_calls, _, _ in rows} == {("ended", 1)}  # ... that ended once
    assert "episode server: http://127.0.0.1:" in completed.stdout


def _start_worker(url: str, script: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "nexrl_episodes.worker", "worker", url, str(script), "--concurrency", "16"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _server_url(out: Path, trainer: subprocess.Popen[str], deadline: float) -> str:
    info = out / "rollout" / "episode_server.json"
    while not info.exists():
        assert trainer.poll() is None, trainer.communicate()
        assert time.monotonic() < deadline, "the episode server did not start"
        time.sleep(0.2)
    return json.loads(info.read_text())["base_url"]


DOUBLE_ENDER = """
import sys
sys.path.insert(0, {worker_dir!r})
from addition_worker import rollout as solve

def rollout(episode):
    reward = solve(episode)
    assert episode.client.end(episode, reward) is False
    assert episode.client.end(episode, 1.0 - reward) is True  # a repeat: acknowledged, ignored
    return reward
"""


@pytest.mark.slow
def test_killed_clients_and_a_killed_trainer_lose_no_episode(tmp_path: Path) -> None:
    """Clients die by SIGKILL mid-episode and come back; every episode still ends exactly once.
    Then the trainer dies by SIGKILL; ``--resume`` reuses every episode that had ended."""
    script = tmp_path / "double_ender.py"
    script.write_text(DOUBLE_ENDER.format(worker_dir=str(WORKER.parent)))
    out = tmp_path / "run"
    command = [
        NEXRL,
        "train",
        str(RECIPE),
        f"output.dir={out}",
        "rollout.source.options.local_workers.processes=0",
        "rollout.source.options.claim_timeout_s=3",
        "schedule.steps=8",
        "schedule.validate_every=0",
        "schedule.checkpoint_every=4",
        "--no-progress",
    ]
    trainer = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    workers: list[subprocess.Popen[bytes]] = []
    try:
        deadline = time.monotonic() + 240
        url = _server_url(out, trainer, deadline)
        workers = [_start_worker(url, script) for _ in range(5)]
        kills = 0
        while not (out / "run_state.json").exists() or json.loads((out / "run_state.json").read_text())["step"] < 4:
            assert trainer.poll() is None, trainer.communicate()[0]
            assert time.monotonic() < deadline, "the run made no progress"
            time.sleep(3.0)
            victim = kills % len(workers)  # one of the five (20 %) killed mid-episode, then restarted
            workers[victim].send_signal(signal.SIGKILL)
            workers[victim].wait()
            workers[victim] = _start_worker(url, script)
            kills += 1
        while not any(row[1] == "ended" and row[4] > 4 for row in episode_rows(out)):
            assert trainer.poll() is None, "the run ended before the trainer could be killed mid-step"
            time.sleep(0.05)
        trainer.send_signal(signal.SIGKILL)  # mid-step 5: some of its episodes ended, others not
        trainer.wait()
        ended_before = {row[0]: row for row in episode_rows(out) if row[1] == "ended"}
        assert kills >= 2 and ended_before

        (out / "rollout" / "episode_server.json").unlink()  # the dead server's address
        resumed = subprocess.Popen([*command, "--resume"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
        url = _server_url(out, resumed, time.monotonic() + 120)  # the file is rewritten by the new server
        for worker in workers:
            worker.kill()
            worker.wait()
        workers = [_start_worker(url, script) for _ in range(2)]
        output, _ = resumed.communicate(timeout=240)
        assert resumed.returncode == 0, output
    finally:
        for process in [trainer, *workers]:
            if process.poll() is None:
                process.kill()
                process.wait()
    rows = {row[0]: row for row in episode_rows(out)}
    assert all(rows[episode_id] == row for episode_id, row in ended_before.items())  # nothing ended was redone
    assert len(rows) == 8 * 128 and {row[1] for row in rows.values()} == {"ended"}
    assert sum(row[2] > 1 for row in rows.values()) > 0.9 * len(rows)  # the repeats reached the server
