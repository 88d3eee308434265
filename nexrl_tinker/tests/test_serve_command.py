"""`nexrl serve tinker` as a user runs it: --api-key / NEXRL_API_KEY, --host, --model, --dtype,
and bad options refused with a one-line message, exit status 2 and no traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from nexrl_tinker.testing import free_port, wait_healthy

NEXRL = str(Path(sys.executable).with_name("nexrl"))


def serve(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    command = [NEXRL, "serve", "tinker", "--data-dir", str(tmp_path / "data"), *args]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **(env or {})})


@pytest.fixture
def stop() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        process.terminate()
        process.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize("key_from", ["flag", "env"])
def test_the_key_host_and_model_flags(tmp_path: Path, stop: list, key_from: str) -> None:
    port = free_port()
    args = ["--port", str(port), "--host", "127.0.0.1", "--model", "nexrl-tiny", "--model-name", "myorg/tiny", "--dtype", "bf16"]
    args, env = (args + ["--api-key", "tml-secret"], None) if key_from == "flag" else (args, {"NEXRL_API_KEY": "tml-secret"})
    stop.append(serve(tmp_path, *args, env=env))
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, timeout=120)
    assert httpx.post(f"{url}/api/v1/create_session", json={}, timeout=30).status_code == 401
    answer = httpx.post(f"{url}/api/v1/create_session", json={}, headers={"X-API-Key": "tml-secret"}, timeout=30)
    assert answer.status_code == 200, answer.text
    info = httpx.get(f"{url}/api/v1/get_server_capabilities", headers={"X-API-Key": "tml-secret"}, timeout=30).json()
    assert [model["model_name"] for model in info["supported_models"]] == ["myorg/tiny"]
    said = httpx.get(f"{url}/api/v1/nexrl_capabilities", headers={"X-API-Key": "tml-secret"}, timeout=30).json()
    assert said["dtype"] == "bf16", "the service trains in the --dtype it was started with"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/nonexistent"], "unknown model '/nonexistent'"),
        (["--port", "70000"], "Invalid value for '--port'"),
        (["--dtype", "fp8"], "Invalid value for '--dtype'"),
        (["--max-tokens-per-microbatch", "0"], "Invalid value for '--max-tokens-per-microbatch'"),
        ("taken", "--port/--host: cannot listen on 127.0.0.1"),
    ],
)
def test_bad_options_are_refused_cleanly(tmp_path: Path, args: list[str] | str, message: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        if args == "taken":
            args = ["--port", str(taken.getsockname()[1])]
        done = subprocess.run(
            [NEXRL, "serve", "tinker", "--data-dir", str(tmp_path / "data"), *args], capture_output=True, text=True, timeout=120
        )
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr, done.stderr
