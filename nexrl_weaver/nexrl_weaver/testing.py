"""Helpers for tests that run a real local Weaver service (ours, and other
distributions' end-to-end tests). Nothing here mocks anything: `start_service`
starts the real server on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["BASE_MODEL", "TEST_API_KEY", "sdk_client", "start_service"]

BASE_MODEL = "nexrl-tiny"
TEST_API_KEY = "sk-nexrl-test"


def start_service(data_dir: str | Path, **options: Any) -> Any:
    """A started `WeaverService` on a free port (stop it with ``.stop()``); ``options`` are
    those of `nexrl_service.testing.start_local_service` (``api_key``, ``workers``, ...)."""
    from nexrl_service.testing import start_local_service
    from nexrl_weaver.server.service import WeaverService

    return start_local_service(WeaverService, data_dir, **options)


def sdk_client(base_url: str, **options: Any) -> Any:
    """A ``weaver.ServiceClient`` with the holder's heartbeat period, so that closing it
    takes at most a second, not the 5 s the SDK's default period costs; ``options`` are
    the client's own (``api_key``, ``session_id``, ...)."""
    import weaver

    from nexrl_weaver.holder import HEARTBEAT_S

    return weaver.ServiceClient(base_url=base_url, heartbeat_interval=HEARTBEAT_S, **options)
