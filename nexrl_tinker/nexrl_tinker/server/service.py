"""`TinkerService`: TinkerCloud as a `nexrl_service.server.LocalService`.

The runtime serves it (thread, child process or foreground); this class only names
the protocol and hands over its routes. ``nexrl serve tinker`` and the embedded
service of ``nexrl train`` construct it from `ServeOptions`.
"""

from __future__ import annotations

from typing import Any

from nexrl_service.runtime import LocalService
from nexrl_tinker.server.routes.client import TELEMETRY_ANSWER, TELEMETRY_PATH

__all__ = ["TinkerService"]


class TinkerService(LocalService):
    """The local Tinker-compatible service ("TinkerCloud")."""

    name = "tinker"
    title = "TinkerCloud"
    background_answers = {TELEMETRY_PATH: TELEMETRY_ANSWER}
    serves_sampling_models = True

    def create_app(self, state: Any) -> Any:
        # Imported where the app is built (the serving process), not by a parent that only starts it.
        from nexrl_tinker.server.app import create_app

        return create_app(state)
