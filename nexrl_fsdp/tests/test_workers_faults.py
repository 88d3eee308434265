"""Worker groups that stop: resume from a sharded checkpoint after killing everything, and a
rank killed during update_actor (a clear error within the timeout, nothing left running)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import attrs
import pytest
import torch

from nexrl_core.training.backend import BackendLost
from nexrl_core.training.batch import Batch
from nexrl_core.types import Trajectory
from nexrl_fsdp.direct_zmq.launch import WorkerGroup
from nexrl_fsdp.direct_zmq.transport import WorkerGroupError
from nexrl_fsdp.local_placer import LocalPlacer
from nexrl_fsdp.selfhosted.backend import start_group
from nexrl_fsdp.selfhosted.config import SelfHostedBackendConfig

pytestmark = pytest.mark.slow

OPTIONS = {"loss_fn": "importance_sampling", "optimizer": {"learning_rate": 1e-3}, "micro_batch_rows": 4}


def _batch(seed: int, rows: int = 4) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    runs = []
    for index in range(rows):
        tokens = torch.randint(1, 1000, (8,), generator=generator).tolist()
        runs.append(
            Trajectory(
                tokens=tokens,
                loss_mask=[0] * 3 + [1] * 5,
                logprobs=[0.0] * 3 + [-2.0] * 5,
                reward=0.0,
                group_id="g",
                run_id=index,
                task_id="t",
            )
        )
    batch = Batch.from_trajectories(runs, pad_token_id=0)
    batch.tensors["advantages"] = batch.tensors["loss_mask"] * torch.linspace(-1, 1, rows)[:, None]
    return batch


def _group(tmp_path: Path, name: str, dead_after_s: float = 3) -> WorkerGroup:
    """Two local ranks, with ``backend.options`` that notice a silent rank within seconds."""
    fast_faults = SelfHostedBackendConfig(heartbeat_s=0.5, dead_after_s=dead_after_s, op_timeout_s=120)
    group = start_group(fast_faults, tmp_path / f"{name}.log", LocalPlacer(), extra_env={"NEXRL_WORKER_COLLECTIVE_TIMEOUT_S": "60"})
    group.transport.init_model("nexrl-tiny")
    return group


def _gone(pids: list[int], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{pid}").exists() for pid in pids):
            return True
        time.sleep(0.2)
    return False


def test_save_kill_load_continue_gives_the_same_next_step(tmp_path: Path) -> None:
    first = _group(tmp_path, "first")
    try:
        first.transport.update_actor(_batch(1), OPTIONS)
        first.transport.save_checkpoint(str(tmp_path / "ckpt"))
        uninterrupted = first.transport.update_actor(_batch(2), OPTIONS)
        pids = [first.placed.process.pid, *first.rank_pids().values()]
        for pid in pids:  # everything, without a goodbye
            os.kill(pid, signal.SIGKILL)
        first.placed.process.wait()
    finally:
        first.stop()
    assert _gone(pids, 10)
    second = _group(tmp_path, "second")
    try:
        second.transport.load_checkpoint(str(tmp_path / "ckpt"))
        resumed = second.transport.update_actor(_batch(2), OPTIONS)
    finally:
        second.stop()
    assert resumed["loss:sum"] == pytest.approx(uninterrupted["loss:sum"], abs=1e-6)
    assert resumed["actor/grad_norm"] == pytest.approx(uninterrupted["actor/grad_norm"], rel=1e-6)


def test_a_rank_killed_during_update_actor_is_a_clear_error_and_nothing_hangs(tmp_path: Path) -> None:
    group = _group(tmp_path, "killed", dead_after_s=30)
    try:
        pids = group.rank_pids()
        killer = threading.Timer(1.0, os.kill, args=(pids[1], signal.SIGKILL))
        killer.start()
        started = time.monotonic()
        # Rank 1's watchdog reports its exit at once; rank 0 may report its broken collective
        # first. Either way the group is dead within a heartbeat, not after dead_after_s.
        with pytest.raises(WorkerGroupError, match=r"worker group 'actor' is dead during update_actor: rank [01] failed: ") as raised:
            group.transport.update_actor(_batch(3, rows=8), {**OPTIONS, "ppo_epochs": 500})
        assert time.monotonic() - started < 1.0 + 10, "the group's death is known at once, not when its heartbeats time out (30 s)"
        assert str(tmp_path / "killed.log") in str(raised.value), "the error names the ranks' log"
        torchrun = group.placed.process.pid
    finally:
        group.stop()
    assert _gone([*pids.values(), torchrun], 20)


def _watchdog_of(rank_pid: int) -> int:
    """The watchdog process that beats for the rank with process id ``rank_pid``."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"nexrl_fsdp.worker.watchdog" in argv and argv[argv.index(b"--pid") + 1] == str(rank_pid).encode():
            return int(proc.name)
    raise AssertionError(f"no watchdog beats for pid {rank_pid}")


def test_a_group_whose_watchdog_died_between_ops_is_lost_at_the_next_op(tmp_path: Path) -> None:
    """A rank's watchdog killed between two ops: nothing beats for the rank, so the rank
    says so and leaves, the API server calls the group dead within seconds (not after
    ``dead_after_s``), and the next op is a `BackendLost` (which the loop answers with a
    restart), not a refused request that ends the run."""
    group = _group(tmp_path, "unwatched", dead_after_s=600)
    try:
        pids = group.rank_pids()
        os.kill(_watchdog_of(pids[1]), signal.SIGKILL)
        deadline = time.monotonic() + 20
        while group.transport.info()["status"] != "dead":
            assert time.monotonic() < deadline, "the unwatched rank did not leave its group"
            time.sleep(0.2)
        with pytest.raises(
            BackendLost, match=r"worker group 'actor' is dead before update_actor: rank 1 failed: \S*WatchdogGone: its watchdog"
        ):
            group.transport.update_actor(_batch(3), OPTIONS)
        launcher = group.placed.process.pid
    finally:
        group.stop()
    assert _gone([*pids.values(), launcher], 20)


def test_a_rank_cut_off_with_its_watchdog_during_an_op_is_found_by_its_silence(tmp_path: Path) -> None:
    """A node cut off without dying: rank 1 and its watchdog stopped (SIGSTOP) while an
    update runs. Nothing exits and nothing reports; only the heartbeats' silence tells,
    and the driver learns it within ``dead_after_s`` (3 s), not at the op's deadline (120 s)."""
    group = _group(tmp_path, "cut-off")
    stopped: list[int] = []
    try:
        pids = group.rank_pids()
        stopped = [pids[1], _watchdog_of(pids[1])]
        freezer = threading.Timer(1.0, lambda: [os.kill(pid, signal.SIGSTOP) for pid in stopped])
        freezer.start()
        started = time.monotonic()
        with pytest.raises(BackendLost, match=r"ranks \[1\] stopped beating"):
            group.transport.update_actor(_batch(3, rows=8), {**OPTIONS, "ppo_epochs": 5000})
        assert time.monotonic() - started < 1.0 + 3 + 20, "silence is noticed after dead_after_s, not at the op deadline"
        launcher = group.placed.process.pid
    finally:
        group.stop()
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    assert _gone([*pids.values(), launcher], 20)


def test_a_killed_rank_not_yet_reaped_counts_as_gone() -> None:
    """The watchdog stops beating for a rank the moment it dies, before torchrun reaps it."""
    from nexrl_fsdp.worker.watchdog import _alive

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child.pid}/stat").read_bytes().rpartition(b")")[2].split()[0] != b"Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not _alive(child.pid), "a zombie is not alive"
    child.wait()
    assert not _alive(child.pid) and _alive(os.getpid())


def test_a_frozen_rank_is_a_lost_group_within_the_op_deadline(tmp_path: Path) -> None:
    """A rank stopped with SIGSTOP mid-update (its peer then waits in a collective) is
    caught by the op deadline, not the collective's own 600 s: the error is a
    `BackendLost`, which the loop answers with a restart, and nothing is left running.
    The group starts and loads under a deadline any machine meets; only the frozen op
    runs under the tight one."""
    group = WorkerGroup(
        2,
        tmp_path / "frozen.log",
        heartbeat_s=0.5,
        dead_after_s=3,
        op_timeout_s=300,
        extra_env={"NEXRL_WORKER_COLLECTIVE_TIMEOUT_S": "600"},
    )
    try:
        group.transport.init_model("nexrl-tiny")
        group.transport.options = attrs.evolve(group.transport.options, op_timeout_s=6)
        pids = group.rank_pids()
        freezer = threading.Timer(1.0, os.kill, args=(pids[1], signal.SIGSTOP))
        freezer.start()
        started = time.monotonic()
        with pytest.raises(BackendLost, match="worker group 'actor' (did not answer update_actor to finish within the op timeout|is dead)"):
            group.transport.update_actor(_batch(3, rows=8), {**OPTIONS, "ppo_epochs": 500})
        assert time.monotonic() - started < 6 + 15, "the op deadline, not the collective's 600 s"
        torchrun = group.placed.process.pid
    finally:
        group.stop()
    assert _gone([*pids.values(), torchrun], 20)


def test_a_rank_that_cannot_start_is_named_at_once(tmp_path: Path) -> None:
    """A rank that fails before it joins (here: a device setting it refuses) reports its
    exception to the API server as it exits: starting the group fails with that line and
    the log's path as the rank exits, not after the connect timeout, and nothing is left."""
    started = time.monotonic()
    with pytest.raises(WorkerGroupError, match=r"rank [01] failed: ValueError: NEXRL_WORKER_DEVICE='tpu': use cpu or cuda") as raised:
        WorkerGroup(2, tmp_path / "bad.log", heartbeat_s=0.5, connect_timeout_s=90, extra_env={"NEXRL_WORKER_DEVICE": "tpu"})
    assert time.monotonic() - started < 60, "named when the rank exits (seconds), not at the connect timeout (90 s)"
    assert str(tmp_path / "bad.log") in str(raised.value)
