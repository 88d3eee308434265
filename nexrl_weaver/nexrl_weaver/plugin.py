"""Entry-point module of nexrl-weaver: registers the ``weaver`` service and holder.

Loaded whenever the core builds its registries (``nexrl plugins`` included), so it
imports nothing heavy: both are named by ``"module:attr"`` strings and only
imported when ``nexrl serve weaver``, an embedded run or a recipe picks them.
"""

from __future__ import annotations

from nexrl_remote_api.protocol_plugin import protocol_hooks
from nexrl_weaver.holder_config import WeaverHolderConfig

nexrl_services, nexrl_service_holders = protocol_hooks(
    "weaver",
    service="nexrl_weaver.server.service:WeaverService",
    service_description="Local Weaver-compatible service (nex-weaver 1.19 wire protocol) on the nexrl-engine engine",
    wire="weaver-sdk-1.19",
    holder="nexrl_weaver.holder:WeaverServiceHolder",
    holder_config=WeaverHolderConfig,
    holder_description="nex-weaver SDK client: sampling and training on hosted Weaver or the local service",
)
