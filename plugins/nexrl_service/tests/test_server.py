"""`LocalService` with a protocol of a few lines: port 0, a busy port, clean stop."""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from nexrl_core.serving import ServeOptions, ServiceStartError
from nexrl_service.server import LocalService
from nexrl_service.state import ServiceState


class EchoService(LocalService):
    """The smallest protocol: a health route and one that reads the shared state."""

    name = "echo"
    title = "Echo service"

    def create_app(self, state: ServiceState) -> Any:
        from fastapi import FastAPI

        app = FastAPI()

        @app.get("/api/v1/healthz")
        def healthz() -> dict[str, Any]:
            return {"status": "ok", "model": state.base.name, "epoch": state.book.epoch}

        return app


def test_port_zero_serves_and_stop_leaves_no_threads(tmp_path: Path) -> None:
    before = {t.ident for t in threading.enumerate()}
    service = EchoService(ServeOptions(port=0, data_dir=str(tmp_path)))
    url = service.start()
    assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
    answer = httpx.get(f"{url}/api/v1/healthz").json()
    assert answer == {"status": "ok", "model": "nexrl-tiny", "epoch": service.state.book.epoch}
    with pytest.raises(RuntimeError, match="already running"):
        service.start()
    service.stop()
    service.stop()  # idempotent
    leftovers = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert leftovers == [], leftovers
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/api/v1/healthz", timeout=2)
    assert (tmp_path / "echo.db").is_file(), "the database is named after the protocol and stays"


def test_busy_port_fails_in_start(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        service = EchoService(ServeOptions(port=port, data_dir=str(tmp_path)))
        with pytest.raises(ServiceStartError, match=f"cannot listen on 127.0.0.1:{port}"):
            service.start()
        assert service.state is None
