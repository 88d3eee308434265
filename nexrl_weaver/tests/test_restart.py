"""``nexrl serve weaver`` killed with SIGKILL and started again on the same data keeps
its sessions and ``weaver://`` checkpoints, with its state on SQLite and on PostgreSQL."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from weaver.types import ModelInput, SamplingParams

from nexrl_weaver.testing import sdk_client


def _serve(port: int, data_dir: Path, db: str) -> subprocess.Popen[bytes]:
    nexrl = Path(sys.executable).with_name("nexrl")
    process = subprocess.Popen(
        [str(nexrl), "serve", "weaver", "--port", str(port), "--data-dir", str(data_dir), "--db", db],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/api/v1/healthz", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("nexrl serve weaver did not start")


@pytest.mark.slow
# SQLite only: a kill -9 of the service cannot touch what a separate PostgreSQL server has
# committed; what the test proves (each answer committed before it is sent, WAL kept) is
# the in-process store's, and PostgreSQL's dialect is covered by the store and concurrency tests.
@pytest.mark.parametrize("sql_url", ["sqlite"], indirect=True)
def test_kill_9_keeps_sessions_and_checkpoints(tmp_path: Path, sql_url: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = _serve(port, tmp_path, sql_url)
    try:
        client = sdk_client(url)
        client.connect()
        model = client.create_model(base_model="nexrl-tiny", training_mode="full_ft")
        checkpoint = model.save_state(name="before-crash")
        session_id = client.session_id
        os.kill(server.pid, signal.SIGKILL)
        server.wait(timeout=30)
        server = _serve(port, tmp_path, sql_url)

        again = sdk_client(url, session_id=session_id)
        again.connect()
        assert again.session_id == session_id
        assert checkpoint.path in [c.path for c in model.list_checkpoints()]
        sampler = again.create_sampling_client(model_path=checkpoint.path, base_model="nexrl-tiny")
        assert sampler.sample(prompt=ModelInput.from_ints([1, 5, 6]), sampling_params=SamplingParams(max_tokens=2, seed=1))["sequences"]
        fresh = again.create_model(base_model="nexrl-tiny", training_mode="full_ft")
        assert fresh.load_state_with_optimizer(checkpoint.path)["path"] == checkpoint.path
        again.close()
        client.close()  # terminates the first model, which the restarted service still holds
    finally:
        server.terminate()
        server.wait(timeout=60)
