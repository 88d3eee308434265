"""The plugin registration and the `Service` protocol: start, port 0, stop without leftovers."""

from __future__ import annotations

import subprocess
import sys
import threading

import httpx
from nexrl_tinker.testing import TEST_API_KEY, start_service


def test_plugin_registers_the_tinker_service() -> None:
    from nexrl_core.registry import find_spec
    from nexrl_core.serving import ServeOptions

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


def test_busy_port_fails_in_start(tmp_path) -> None:
    import socket

    from nexrl_tinker.server.service import TinkerService

    from nexrl_core.serving import ServeOptions

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        service = TinkerService(ServeOptions(port=port, data_dir=str(tmp_path)))
        try:
            service.start()
            raise AssertionError("start() on a busy port must fail")
        except RuntimeError as exc:
            assert str(port) in str(exc)
