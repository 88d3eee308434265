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
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from nexrl_core.run.loop import RESTARTS_METRIC
from nexrl_testing.processes import processes_running, processes_with

NEXRL = str(Path(sys.executable).with_name("nexrl"))
STEPS, CHECKPOINT = 8, 4
EXACT = ("reward/", "advantages/", "rollout/runs", "rollout/trajectories", "datums/", "groups/", "grpo/", "score/")
"""Metrics that must match exactly: what was sampled and how it was scored."""


SMALL = ("rollout.prompts_per_step=4", "rollout.group_size=4")
"""Sixteen runs a step instead of the quickstart's 128, for the tests whose kill comes at a
checkpoint or after a step, not at a moment inside one: what they compare (every step's
numbers after a resume or a stop) does not depend on the size of a step. An 8-step run
took 14 s instead of 29 s in-process, 26 s instead of 33 s on the embedded service and
32 s instead of 57 s self-hosted (the self-hosted healing run keeps its size: its kills
are timed within steps)."""


SELF_HOSTED_PASSES = "backend.options.update.micro_batch_rows=64"
"""A rank's whole share of a step in one forward/backward, as `recipes/quickstart_fsdp.yaml`
sets: the built-in quickstart's default of 8 rows made 8 passes per rank per op, and an
8-step run took 44 s instead of 32 s (the step's numbers do not depend on the passes)."""


ADAPTIVE_KL = (
    "algorithm.kl.coef=0.05",
    "algorithm.kl.controller=adaptive",
    "algorithm.kl.target=0.0001",
    "algorithm.kl.horizon=50",
    *SMALL,
)
"""A trainer state that moves every step (the coefficient grows towards a far target),
so a resume that does not restore it starts the coefficient over and shows."""


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
    if backend == "self-hosted":
        overrides.append(SELF_HOSTED_PASSES)
    return [NEXRL, "train", *overrides, *extra]


def training_rows(out_dir: Path) -> dict[int, dict[str, float]]:
    """The last logged row of each training step."""
    rows: dict[int, dict[str, float]] = {}
    for line in (out_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("step", 0) >= 1 and "reward/mean" in row:
            rows[int(row["step"])] = row
    return rows


def kill_after_checkpoint(out_dir: Path, backend: str, *extra: str) -> None:
    """Run until the step-CHECKPOINT checkpoint is recorded, then SIGKILL the whole job."""
    state = out_dir / "run_state.json"
    process = subprocess.Popen(
        command(out_dir, backend, *extra), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 300
        while not (state.exists() and json.loads(state.read_text() or "{}").get("step") == CHECKPOINT):
            assert process.poll() is None, "the run ended before its checkpoint"
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.05)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=60)


StraightRun = Callable[..., Path]
"""``straight_run(backend, *overrides)``: the output folder of an uninterrupted run."""


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory: pytest.TempPathFactory) -> StraightRun:
    """Uninterrupted runs, each made once for the module: the killed runs of several
    tests compare with the same one."""
    made: dict[tuple[str, ...], Path] = {}

    def run(backend: str, *extra: str) -> Path:
        key = (backend, *extra)
        if key not in made:
            out_dir = tmp_path_factory.mktemp("straight") / "run"
            subprocess.run(command(out_dir, backend, *extra), check=True, capture_output=True, timeout=600)
            made[key] = out_dir
        return made[key]

    return run


VALIDATED = 6
VALIDATE = f"schedule.validate_every={VALIDATED // 2}"
"""Validation at steps 0, 3 and 6 (with a checkpoint at 4): killed runs cross both."""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "extra"),
    [("remote_api", SMALL), ("inprocess", SMALL), ("self-hosted", (VALIDATE,))],
    ids=["remote_api", "inprocess", "self-hosted"],
)
def test_resume_after_a_hard_kill_matches_an_uninterrupted_run(
    tmp_path: Path, backend: str, extra: tuple[str, ...], straight_run: StraightRun
) -> None:
    """(The self-hosted runs validate, so their uninterrupted run is the one the healing
    tests compare with: it is made once.)"""
    straight, resumed = straight_run(backend, *extra), tmp_path / "resumed"
    kill_after_checkpoint(resumed, backend, *extra)
    done = subprocess.run(command(resumed, backend, *extra, "--resume"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    expected, got = training_rows(straight), training_rows(resumed)
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1))
    for step in range(CHECKPOINT + 1, STEPS + 1):
        for key, value in expected[step].items():
            if key.startswith(EXACT):
                assert got[step][key] == value, f"step {step} {key}: {got[step][key]} != {value}"
            elif key.startswith("train/"):
                assert got[step][key] == pytest.approx(value, rel=1e-4, abs=1e-4), f"step {step} {key}"


@pytest.mark.slow
def test_resume_after_a_hard_kill_restores_the_trainer_state(tmp_path: Path, straight_run: StraightRun) -> None:
    """The remote-API backend's checkpoint carries the trainer's state: an adaptive KL
    coefficient resumed after SIGKILL goes on from where it was (KL in the reward makes
    the other numbers differ in rounding, so this test compares the coefficient only)."""
    straight, resumed = straight_run("remote_api", *ADAPTIVE_KL), tmp_path / "resumed"
    kill_after_checkpoint(resumed, "remote_api", *ADAPTIVE_KL)
    done = subprocess.run(command(resumed, "remote_api", *ADAPTIVE_KL, "--resume"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    expected, got = training_rows(straight), training_rows(resumed)
    coefs = [expected[step]["kl/coef"] for step in range(1, STEPS + 1)]
    assert coefs[-1] > coefs[0] * 1.05, f"the coefficient did not move: {coefs}"
    assert [got[step]["kl/coef"] for step in range(1, STEPS + 1)] == pytest.approx(coefs, rel=1e-3)


def last_rank(marker: str) -> int:
    ranks = processes_running(marker, "nexrl_fsdp.worker")
    assert len(ranks) == 2, ranks
    return ranks[-1]


def last_watchdog(marker: str) -> int:
    """The newest watchdog, which beats for one rank (the rank itself runs on, unwatched)."""
    watchdogs = processes_running(marker, "nexrl_fsdp.worker.watchdog")
    assert len(watchdogs) == 2, watchdogs
    return watchdogs[-1]


def launcher(marker: str) -> int:
    """The process that started the group's ranks (and whose end their watchdogs watch for)."""
    (pid,) = processes_running(marker, "nexrl_fsdp.worker.loopback")
    return pid


def sampler_process(marker: str) -> int:
    (pid,) = processes_running(marker, "nexrl_fsdp.selfhosted.sampler_server")
    return pid


def embedded_service(marker: str) -> int:
    (pid,) = processes_running(marker, "nexrl_service.server")
    return pid


HEALING = ("backend.options.heartbeat_s=0.5", "backend.options.dead_after_s=3")
"""Notice a dead rank within seconds (results do not depend on it)."""


Moment = Callable[[Path], bool]
"""When to kill, judged from the run's output folder."""
Victim = Callable[[str], int]
"""Which process to kill: its pid among the processes carrying the run's marker."""


def after_step(step: int, restarts: int = 0) -> Moment:
    """A kill moment: step ``step``'s row is logged by the run after its ``restarts``-th
    restart (the next step's rollouts, and its validation where one is due, run meanwhile)."""

    def logged(out_dir: Path) -> bool:
        row = training_rows(out_dir).get(step) if (out_dir / "metrics.jsonl").exists() else None
        return row is not None and row.get(RESTARTS_METRIC, 0) == restarts

    return logged


def during_save(step: int) -> Moment:
    """A kill moment: the background save of step ``step``'s checkpoint has begun."""
    return lambda out_dir: (out_dir / "backend" / "checkpoints" / f"step_{step:06d}").exists()


def run_and_kill(
    out_dir: Path, backend: str, kills: list[tuple[Victim, Moment]], *extra: str
) -> tuple[subprocess.CompletedProcess[str], str]:
    """Run the quickstart on ``backend``; at each moment of ``kills`` in turn, SIGKILL the
    process its victim picks among the run's; returns the finished run and the marker of
    its processes. The output goes to a file: a pipe nobody reads while the run goes on
    would block the run once its buffer is full."""
    marker = f"NEXRL_TEST_RUN={uuid.uuid4().hex}"
    name, _, value = marker.partition("=")
    log = out_dir.parent / f"{out_dir.name}.log"
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as written:
        process = subprocess.Popen(
            command(out_dir, backend, *extra), stdout=written, stderr=subprocess.STDOUT, env={**os.environ, name: value}
        )
    try:
        deadline = time.monotonic() + 300 * len(kills)
        for victim, moment in kills:
            while not moment(out_dir):
                assert process.poll() is None, "the run ended before its process could be killed: " + log.read_text()[-3000:]
                assert time.monotonic() < deadline, "the moment to kill did not come in time: " + log.read_text()[-3000:]
                time.sleep(0.02)
            os.kill(victim(marker), signal.SIGKILL)
        process.wait(timeout=600)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return subprocess.CompletedProcess(process.args, process.returncode, log.read_text(), ""), marker


@pytest.fixture(scope="module")
def uninterrupted_validated(straight_run: StraightRun) -> Path:
    return straight_run("self-hosted", VALIDATE)


def all_rows(out_dir: Path) -> dict[int, dict[str, float]]:
    """Every step's last row, merged with its validation (step 0: validation alone)."""
    rows: dict[int, dict[str, float]] = {}
    for line in (out_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(int(row.get("step", 0)), {}).update(row)
    return rows


def assert_healed_and_matches(done: subprocess.CompletedProcess[str], marker: str, straight: Path, healed: Path, kills: int) -> None:
    """The run finished after one restart per kill, left no process, and every step's
    numbers (validation included) equal the uninterrupted run's."""
    assert done.returncode == 0, done.stdout[-4000:]
    for restart in range(1, kills + 1):
        assert done.stdout.count(f"restart {restart}:") == 1, done.stdout[-4000:]
    assert f"restart {kills + 1}:" not in done.stdout, done.stdout[-4000:]
    assert not processes_with(marker)
    expected, got = all_rows(straight), all_rows(healed)
    assert sorted(got) == sorted(expected)
    assert sorted(training_rows(healed)) == list(range(1, STEPS + 1))
    for step in sorted(expected):
        for key, value in expected[step].items():
            if key.startswith(EXACT) or key.startswith("val/"):
                assert got[step][key] == value, f"step {step} {key}: {got[step][key]} != {value}"
            elif key.startswith("train/"):
                assert got[step][key] == pytest.approx(value, rel=1e-4, abs=1e-4), f"step {step} {key}"
    restarts = [got[step].get(RESTARTS_METRIC, 0) for step in range(1, STEPS + 1)]
    assert restarts == sorted(restarts) and restarts[-1] == kills, f"one restart per kill, each from its step on: {restarts}"


KILLS: list[tuple[Victim, Moment]] = [
    (last_rank, during_save(CHECKPOINT)),
    (last_watchdog, after_step(VALIDATED - 1, restarts=1)),
    (launcher, after_step(VALIDATED, restarts=2)),
    (sampler_process, after_step(VALIDATED + 1, restarts=3)),
]
"""Every kind of process a self-hosted run starts, each killed once, in one run: a rank
while the workers save a checkpoint; the watchdog that beats for a rank (whose rank then
leaves its group) during the rollouts of a step that validates; the launcher
(whose end the watchdogs answer by ending the ranks) right after that step; the sampler
process, whose death reaches the loop as failed agent runs."""


@pytest.mark.slow
def test_any_killed_process_of_the_run_is_restarted_and_the_run_matches_an_uninterrupted_one(
    uninterrupted_validated: Path, tmp_path: Path
) -> None:
    """Whichever of the run's processes dies, and whenever, the run replaces what died
    once, from the last complete checkpoint, and every step's numbers (validation
    included) equal the uninterrupted run's. The restarts it may make, it makes."""
    healed = tmp_path / "healed"
    done, marker = run_and_kill(healed, "self-hosted", KILLS, *HEALING, VALIDATE, f"backend.options.max_restarts={len(KILLS)}")
    assert "the sampler process" in done.stdout and "is dead" in done.stdout, done.stdout[-4000:]
    assert_healed_and_matches(done, marker, uninterrupted_validated, healed, kills=len(KILLS))


@pytest.mark.slow
def test_a_dead_embedded_service_stops_the_run_in_one_line(tmp_path: Path) -> None:
    """remote_api cannot restart the service it embeds (its models' state is the
    service's); it names the dead service and the --resume command, without a traceback."""
    done, marker = run_and_kill(
        tmp_path / "run", "remote_api", [(embedded_service, after_step(CHECKPOINT + 1))], "backend.options.holder.max_retries=1", *SMALL
    )
    assert done.returncode == 1, done.stdout[-4000:]
    assert "Traceback" not in done.stdout, done.stdout[-4000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("Error:")]
    assert "died (exit status -9; its output: " in line and "server.log" in line, line
    assert f"the last checkpoint (step {CHECKPOINT}) is intact; continue with: nexrl train" in done.stdout
    assert not processes_with(marker)


@pytest.mark.slow
def test_with_no_restarts_left_a_lost_rank_stops_the_run_in_one_line(tmp_path: Path) -> None:
    done, marker = run_and_kill(
        tmp_path / "run", "self-hosted", [(last_rank, after_step(CHECKPOINT + 1))], *HEALING, "backend.options.max_restarts=0", *SMALL
    )
    assert done.returncode == 1, done.stdout[-4000:]
    assert "Traceback" not in done.stdout, done.stdout[-4000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("Error:")]
    assert "stopped beating" in line or "is dead" in line, line
    assert f"the last checkpoint (step {CHECKPOINT}) is intact; continue with: nexrl train" in line and line.endswith("--resume"), line
    assert not processes_with(marker)
