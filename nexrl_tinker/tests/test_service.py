"""The plugin registration and the `Service` protocol: start, port 0, stop without leftovers."""

from __future__ import annotations

import subprocess
import sys
import threading

import httpx
import pytest

from nexrl_testing.processes import process_gone
from nexrl_tinker.testing import TEST_API_KEY, start_service


def test_plugin_registers_the_tinker_service() -> None:
    from nexrl_core.http.serving import ServeOptions
    from nexrl_core.plugins.registry import find_spec

    spec = find_spec("services", "tinker")
    assert spec.config_class is ServeOptions
    assert spec.factory == "nexrl_tinker.server.service:TinkerService"
    from nexrl_tinker.server.service import TinkerService

    assert spec.resolve_factory() is TinkerService


def test_plugin_module_import_is_cheap() -> None:
    code = (
        "import sys, nexrl_tinker.plugin\n"
        "heavy = [m for m in ('torch', 'fastapi', 'uvicorn', 'sqlalchemy', 'tinker', 'transformers') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


def test_port_zero_start_stop_leaves_no_threads(tmp_path) -> None:
    before = {t.ident for t in threading.enumerate()}
    service = start_service(tmp_path)
    url = service.base_url
    assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
    assert httpx.get(f"{url}/api/v1/healthz").json()["status"] == "ok"
    config = httpx.post(f"{url}/api/v1/client/config", json={"sdk_version": "0.38.0"}, headers={"X-API-Key": TEST_API_KEY})
    assert config.json()["pjwt_auth_enabled"] is False and config.json()["sample_use_retrieve_futures"] is False
    service.stop()
    service.stop()  # idempotent
    leftovers = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert leftovers == [], leftovers
    try:
        httpx.get(f"{url}/api/v1/healthz", timeout=2)
        raise AssertionError("the server still answers after stop()")
    except httpx.HTTPError:
        pass
    # The database and the data dir stay for the next start.
    assert (tmp_path / "tinker.db").is_file()


def test_separate_process_starts_answers_and_stop_leaves_no_process(tmp_path) -> None:
    """The Tinker routes and their key from the child process ``nexrl train`` embeds (the
    child's own life, its parent's death and a failed start: nexrl_service's
    tests/test_separate_process.py)."""
    from nexrl_core.http.serving import ServeOptions
    from nexrl_tinker.server.service import TinkerService

    before = {t.ident for t in threading.enumerate()}
    options = ServeOptions(port=0, data_dir=str(tmp_path), api_key=TEST_API_KEY, separate_process=True)
    service = TinkerService(options)
    url = service.start()
    pid = service.pid
    assert pid is not None and service.state is None
    assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
    assert httpx.get(f"{url}/api/v1/healthz").json()["status"] == "ok"
    config = httpx.post(f"{url}/api/v1/client/config", json={"sdk_version": "0.38.0"}, headers={"X-API-Key": TEST_API_KEY})
    assert config.status_code == 200 and config.json()["pjwt_auth_enabled"] is False
    assert httpx.post(f"{url}/api/v1/client/config", json={"sdk_version": "0.38.0"}).status_code == 401
    service.stop()
    service.stop()  # idempotent
    assert service.pid is None and process_gone(pid)
    leftovers = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert leftovers == [], leftovers
    try:
        httpx.get(f"{url}/api/v1/healthz", timeout=2)
        raise AssertionError("the server still answers after stop()")
    except httpx.HTTPError:
        pass
    assert (tmp_path / "tinker.db").is_file() and (tmp_path / "server.log").is_file()


def test_no_cancel_route_and_the_sdk_is_told_not_to_cancel(base_url: str) -> None:
    """The service cannot cancel a queued operation, so it offers no route that would
    answer and do nothing, and tells the SDK (dynamic config) not to send cancels."""
    import httpx

    headers = {"X-API-Key": "tml-test"}
    assert httpx.post(f"{base_url}/api/v1/cancel_future", json={"request_id": "x"}, headers=headers).status_code == 404
    config = httpx.post(f"{base_url}/api/v1/client/dynamic_config", json={}, headers=headers).json()
    assert config["sample_cancel_enabled"] is False


def test_a_dead_services_tombstone_answers_410_and_the_sdk_stops_at_once() -> None:
    """What a dead embedded service leaves on its address: a 410 that tells the SDK not to
    retry. Told to retry (or told nothing for a 5xx), the tinker SDK tries again for about
    a minute per call before the run can report the death."""
    import socket
    import time

    import tinker

    from nexrl_service.tombstone import Tombstone
    from nexrl_tinker.server.service import TinkerService

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        tombstone = Tombstone(sock, "the service died", accepted=TinkerService.background_answers)
        try:
            url = f"http://127.0.0.1:{sock.getsockname()[1]}"
            answer = httpx.post(f"{url}/api/v1/create_session", json={}, timeout=5)
            assert answer.status_code == 410 and answer.headers["x-should-retry"] == "false", answer.headers
            assert answer.json()["detail"] == "the service died"
            started = time.monotonic()
            with pytest.raises(tinker.APIStatusError, match="the service died") as refused:
                tinker.ServiceClient(base_url=url, api_key=TEST_API_KEY).create_lora_training_client("nexrl-tiny", rank=4).result()
            assert refused.value.status_code == 410
            assert time.monotonic() - started < 5, "the SDK retried a call the tombstone refused"
        finally:
            tombstone.close()
