"""``nexrl serve weaver --device``: the service says where its engines live, and a device
this machine lacks is refused at start in one line (exit 2, no traceback)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from nexrl_testing.devices import absent_device
from nexrl_weaver.testing import TEST_API_KEY, start_service

NEXRL = str(Path(sys.executable).with_name("nexrl"))


def test_the_service_says_the_device_it_was_given(tmp_path: Path) -> None:
    service = start_service(tmp_path, api_key=TEST_API_KEY, device="cpu")
    try:
        said = httpx.get(f"{service.base_url}/api/v1/nexrl_capabilities", headers={"X-WEAVER-API-KEY": TEST_API_KEY}, timeout=30)
        assert said.status_code == 200, said.text
        assert said.json()["device"] == "cpu" and service.state.engines.device == "cpu"
    finally:
        service.stop()


def test_nexrl_serve_weaver_refuses_a_device_this_machine_lacks(tmp_path: Path) -> None:
    device = absent_device()
    done = subprocess.run(
        [NEXRL, "serve", "weaver", "--port", "0", "--data-dir", str(tmp_path / "data"), "--device", device],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(f"nexrl serve weaver: --device: '{device}' asks for "), done.stderr
