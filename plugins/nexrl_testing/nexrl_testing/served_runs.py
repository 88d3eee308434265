"""Helpers for end-to-end tests that run ``nexrl serve NAME`` and ``nexrl train`` as a
user does (the GPU tests, files ``test_gpu_*.py``): a service in its own process on a
free port, a training run against it or against its embedded twin, and the held-out
rewards the run recorded (`check_served_run_on_cuda`: each local service's GPU test).
Nothing is mocked."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

__all__ = ["NEXRL", "SERVED_CUDA_RUNS", "check_served_run_on_cuda", "held_out_rewards", "serving", "train"]

NEXRL = str(Path(sys.executable).with_name("nexrl"))
"""The nexrl under test, not whichever is first on PATH."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def serving(name: str, data_dir: Path, *args: str, start_timeout_s: float = 180.0, keeps_files: bool = True) -> Iterator[str]:
    """``nexrl serve NAME --port P --data-dir DATA_DIR ARGS...`` in its own process; yields
    its URL once ``/api/v1/healthz`` answers and stops it (SIGTERM) afterwards. Its
    output goes to ``DATA_DIR/serve.log``, which a failure to start quotes. A service
    that keeps no files (``workers``, which refuses ``--data-dir``) is given
    ``keeps_files=False``: only its log goes to DATA_DIR."""
    port = _free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir / "serve.log"
    data = ["--data-dir", str(data_dir)] if keeps_files else []
    command = [NEXRL, "serve", name, "--port", str(port), *data, *args]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if process.poll() is not None:
                raise AssertionError(f"{' '.join(command)} exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=2) as answer:  # noqa: S310 - our own service
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{' '.join(command)} did not answer within {start_timeout_s:.0f} s:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def train(
    out: Path,
    *overrides: str,
    recipe: Path | None = None,
    env: Mapping[str, str | None] | None = None,
    timeout_s: float = 600.0,
) -> list[dict[str, Any]]:
    """``nexrl train [RECIPE] OVERRIDES... output.dir=OUT --no-progress``; asserts it
    succeeded and returns the rows of its ``metrics.jsonl``. ``env`` is added to (and
    may override) this process's environment; a None value removes the variable."""
    command = [NEXRL, "train", *([str(recipe)] if recipe else []), *overrides, f"output.dir={out}", "--no-progress"]
    merged = {**os.environ, **(env or {})}
    full_env = {key: value for key, value in merged.items() if value is not None}
    completed = subprocess.run(command, capture_output=True, text=True, env=full_env, timeout=timeout_s, cwd=out.parent)
    assert completed.returncode == 0, f"{' '.join(command)}:\n{completed.stdout[-4000:]}\n{completed.stderr[-4000:]}"
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def held_out_rewards(rows: Sequence[Mapping[str, Any]]) -> dict[int, float]:
    """Step -> held-out reward (``val/reward/mean``) of a run's metrics rows."""
    return {int(row["step"]): float(row["val/reward/mean"]) for row in rows if "val/reward/mean" in row}


SERVED_CUDA_RUNS = [pytest.param("fp32", 0, 6, 0.15, id="fp32"), pytest.param("bf16", 8, 12, 0.1, id="bf16-lora8")]
"""``(dtype, lora_rank, steps, rise)`` of the runs `check_served_run_on_cuda` checks: full
fine-tuning in fp32, and LoRA rank 8 in bf16, which needs more steps."""


def check_served_run_on_cuda(
    name: str,
    api_key: str,
    tmp_path: Path,
    dtype: str,
    lora_rank: int,
    steps: int,
    rise: float,
    env: Mapping[str, str | None] | None = None,
) -> None:
    """``nexrl serve NAME --device cuda --dtype DTYPE --api-key API_KEY``, driven by its
    holder's real SDK through ``nexrl train`` against its URL: the run must raise the
    held-out reward by ``rise`` in ``steps`` steps, and the service must say it ran on the
    GPU in that precision. ``env`` is added to the run's environment."""
    with serving(name, tmp_path / "service", "--device", "cuda", "--dtype", dtype, "--api-key", api_key) as url:
        rows = train(
            tmp_path / "run",
            f"backend.options.service_holder={name}",
            f"backend.options.base_url={url}",
            "backend.options.api_key_env=NEXRL_GPU_TEST_KEY",
            f"model.dtype={dtype}",
            f"model.lora.rank={lora_rank}",
            f"schedule.steps={steps}",
            f"schedule.validate_every={steps}",
            f"schedule.checkpoint_every={steps}",
            "task.val_size=128",
            env={"NEXRL_GPU_TEST_KEY": api_key, **(env or {})},
        )
    assert (rows[0]["backend/device"], rows[0]["backend/dtype"]) == ("cuda", "bfloat16" if dtype == "bf16" else "float32")
    rewards = held_out_rewards(rows)
    assert rewards[steps] >= rewards[0] + rise, f"held-out reward did not rise: {rewards}"
