"""`TinkerService`: TinkerCloud as a `nexrl_service.server.LocalService`.

The runtime serves it (thread, child process or foreground); this class only names
the protocol and hands over its routes. ``nexrl serve tinker`` and the embedded
service of ``nexrl train`` construct it from `ServeOptions`.
"""

from __future__ import annotations

from typing import Any

from nexrl_service.runtime import LocalService

__all__ = ["TELEMETRY_ANSWER", "TELEMETRY_PATH", "TinkerService"]

TELEMETRY_PATH = "/api/v1/telemetry"
"""Where the tinker SDK posts its telemetry in the background."""
TELEMETRY_ANSWER = {"status": "accepted"}


class TinkerService(LocalService):
    """The local Tinker-compatible service ("TinkerCloud")."""

    name = "tinker"
    title = "TinkerCloud"
    background_answers = {TELEMETRY_PATH: TELEMETRY_ANSWER}
    serves_sampling_models = True

    def create_app(self, state: Any) -> Any:
        from nexrl_tinker.server.app import create_app

        return create_app(state)
