"""`WeaverService`: the local Weaver-compatible service as a `LocalService`.

The runtime serves it (thread, child process or foreground); this class only names
the protocol and hands over its routes. ``nexrl serve weaver`` and the embedded
service of ``nexrl train`` construct it from `ServeOptions`.
"""

from __future__ import annotations

from typing import Any

from nexrl_service.runtime import LocalService

__all__ = ["WeaverService"]


class WeaverService(LocalService):
    """The local Weaver-compatible service."""

    name = "weaver"
    title = "Local Weaver service"

    def create_app(self, state: Any) -> Any:
        from nexrl_weaver.server.app import create_app

        return create_app(state)
