"""SIGTERM or SIGINT ends ``nexrl train`` within 10 s on every backend, keeping what was
checkpointed and leaving no process behind (worker ranks, watchdogs, the sampler process,
embedded services and their worker groups), and ends ``nexrl serve`` the same way while
it holds a model's worker group. Real commands, real processes, nothing mocked."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from nexrl_testing.processes import processes_with

pytestmark = pytest.mark.slow

NEXRL = str(Path(sys.executable).with_name("nexrl"))
RECIPES = Path(__file__).resolve().parents[1] / "recipes"
LIMIT_S = 10.0

BACKENDS = {
    "tinker-service": [],
    "tinker-service-worker-group": ["backend.options.workers=1"],
    "weaver-service": [str(RECIPES / "quickstart_weaver.yaml")],
    "inprocess": [str(RECIPES / "quickstart_inprocess.yaml")],
    "self-hosted": [str(RECIPES / "quickstart_fsdp.yaml")],
}


def _logged_steps(out: Path) -> int:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    return max((json.loads(line).get("step", 0) for line in lines if line.strip()), default=0)


def _idle_pool_worker(block: str) -> bool:
    """Whether one thread's stack (as faulthandler prints it) is a thread-pool worker waiting for work."""
    lines = block.strip().splitlines()
    return (
        len(lines) > 1
        and lines[0].startswith("Thread ")
        and "concurrent/futures/thread.py" in lines[1]
        and lines[1].endswith(" in _worker")
    )


def _without_idle_threads(output: str) -> str:
    """``output`` with the stacks of thread-pool workers waiting for work folded into a
    count: a run has dozens of them, and CI's log keeps only so much of a failure."""
    blocks = output.split("\n\n")
    kept = [block for block in blocks if not _idle_pool_worker(block)]
    return "\n\n".join([f"({len(blocks) - len(kept)} idle thread-pool workers left out)", *kept])


def _ended_and_gone(process: subprocess.Popen[str], marker: str, sent: float) -> float:
    """Seconds from the signal until the command and every process it started are gone; a
    command still running after 60 s is asked for its threads' stacks (SIGUSR1), then killed,
    and fails the test with its output."""
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGUSR1)
        time.sleep(2)
        process.kill()
        output = process.communicate()[0] or ""
        raise AssertionError(
            f"still running 60 s after the signal; its stacks and output:\n{_without_idle_threads(output)[-8000:]}"
        ) from None
    while processes_with(marker) and time.monotonic() - sent < 60:
        time.sleep(0.05)
    assert not processes_with(marker), f"left running: {processes_with(marker)}"
    return time.monotonic() - sent


@pytest.mark.parametrize(
    ("backend", "received"),
    [*((name, signal.SIGTERM) for name in BACKENDS), ("self-hosted", signal.SIGINT)],
    ids=[*(f"{name}-SIGTERM" for name in BACKENDS), "self-hosted-SIGINT"],
)
def test_a_signal_ends_a_training_run_and_every_process_it_started(tmp_path: Path, backend: str, received: signal.Signals) -> None:
    marker = uuid.uuid4().hex
    out = tmp_path / "run"
    command = [NEXRL, "train", *BACKENDS[backend], f"output.dir={out}", "schedule.checkpoint_every=2", "task.val_size=16", "--no-progress"]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "NEXRL_SIGNAL_TEST": marker},
        # a shell's background job ignores SIGINT, and Python keeps it ignored: restore the default
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.default_int_handler),
    )
    try:
        deadline = time.monotonic() + 240
        while _logged_steps(out) < 3:
            assert process.poll() is None, process.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "no step 3 within 240 s"
            time.sleep(0.05)
        sent = time.monotonic()
        process.send_signal(received)
        took = _ended_and_gone(process, marker, sent)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    output = process.stdout.read() if process.stdout else ""
    assert process.returncode == 130, output[-3000:]
    assert "interrupted: the last checkpoint (step 2) is intact" in output, output[-3000:]
    assert took < LIMIT_S, f"{received.name} took {took:.1f} s to end the run and its processes"


def test_sigterm_ends_a_service_holding_a_worker_group(tmp_path: Path) -> None:
    """``nexrl serve tinker --workers 1`` with a model on its group: SIGTERM ends the
    service, the group's ranks and their watchdogs within the limit."""
    import tinker

    from nexrl_engine.loading import load_tokenizer, resolve_model_dir
    from nexrl_testing.served_runs import serving
    from nexrl_tinker.testing import sft_data

    marker = uuid.uuid4().hex
    os.environ["NEXRL_SIGNAL_TEST"] = marker
    try:
        with serving("tinker", tmp_path / "data", "--workers", "1") as url:
            client = tinker.ServiceClient(base_url=url, api_key="tml-signal-test")
            training = client.create_lora_training_client(base_model="nexrl-tiny", rank=4).result(timeout=120)
            # the model's own tokenizer: the SDK's get_tokenizer() asks the Hub first, which retries for minutes offline
            tokenizer = load_tokenizer(resolve_model_dir("nexrl-tiny"))
            training.forward_backward(sft_data(tokenizer), "cross_entropy").result(timeout=120)
            (service,) = [
                pid for pid in processes_with(marker) if b" serve " in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            ]
            assert len(processes_with(marker)) >= 3, "the service, a rank and its watchdog"
            sent = time.monotonic()
            os.kill(service, signal.SIGTERM)
            while processes_with(marker) and time.monotonic() - sent < 60:
                time.sleep(0.05)
            took = time.monotonic() - sent
            assert not processes_with(marker), f"left running: {processes_with(marker)}"
            assert took < LIMIT_S, f"SIGTERM took {took:.1f} s to end the service and its group"
    finally:
        os.environ.pop("NEXRL_SIGNAL_TEST", None)
