"""`EchoService`: the smallest protocol on the service runtime, for the runtime's own tests
(a separate process imports it by module name, so it lives in a module of its own)."""

from __future__ import annotations

from typing import Any

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
