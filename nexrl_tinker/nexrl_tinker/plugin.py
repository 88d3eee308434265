"""Entry-point module of nexrl-tinker: registers the ``tinker`` service and holder.

Loaded whenever the core builds its registries (``nexrl plugins`` included), so it
imports nothing heavy: the service is named by a ``"module:attr"`` string and only
imported when ``nexrl serve tinker`` (or an embedded run) picks it.
"""

from __future__ import annotations

from nexrl_remote_api.protocol_plugin import protocol_hooks
from nexrl_tinker.holder_config import TinkerHolderConfig

nexrl_services, nexrl_service_holders = protocol_hooks(
    "tinker",
    service="nexrl_tinker.server.service:TinkerService",
    service_description="Local Tinker-compatible service (SDK 0.38 wire protocol) on the nexrl-engine engine",
    wire="tinker-sdk-0.38",
    holder="nexrl_tinker.holder:TinkerServiceHolder",
    holder_config=TinkerHolderConfig,
    holder_description="Tinker SDK client: sampling and training on hosted Tinker or the local service",
)
