"""Helpers for tests that run a real local Weaver service (ours, and other
distributions' end-to-end tests). Nothing here mocks anything: `start_service`
starts the real server on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["BASE_MODEL", "TEST_API_KEY", "start_service"]

BASE_MODEL = "nexrl-tiny"
TEST_API_KEY = "sk-nexrl-test"


def start_service(
    data_dir: str | Path,
    *,
    api_key: str | None = None,
    db: str | None = None,
    workers: int = 0,
    max_worker_groups: int = 4,
    device: str = "cpu",
    **overrides: Any,
) -> Any:
    """A started `WeaverService` on a free port (stop it with ``.stop()``); ``workers`` > 0 trains
    each model on its own worker group of that many ranks; ``device`` is where its own engines live."""
    from nexrl_core.serving import ServeOptions
    from nexrl_weaver.server.service import WeaverService

    options = ServeOptions(
        port=0,
        data_dir=str(data_dir),
        api_key=api_key,
        db=db,
        workers=workers,
        max_worker_groups=max_worker_groups,
        device=device,
    )
    service = WeaverService(options, **overrides)
    service.start()
    return service
