"""Entry-point module of nexrl-weaver: registers the ``weaver`` service and holder.

Loaded whenever the core builds its registries (``nexrl plugins`` included), so it
imports nothing heavy: both are named by ``"module:attr"`` strings and only
imported when ``nexrl serve weaver``, an embedded run or a recipe picks them.
"""

from __future__ import annotations

from nexrl_core.hookspecs import hookimpl
from nexrl_core.serving import ServeOptions
from nexrl_core.specs import ServiceHolderSpec, ServiceSpec
from nexrl_weaver.holder_config import WeaverHolderConfig


@hookimpl
def nexrl_services() -> list[ServiceSpec]:
    """The local Weaver-compatible service on the nexrl-engine engine."""
    return [
        ServiceSpec(
            name="weaver",
            factory="nexrl_weaver.server.service:WeaverService",
            config_class=ServeOptions,
            description="Local Weaver-compatible service (nex-weaver 1.19 wire protocol) on the nexrl-engine engine",
            capabilities=frozenset({"weaver-sdk-1.19", "training", "sampling", "lora", "full-finetune"}),
        )
    ]


@hookimpl
def nexrl_service_holders() -> list[ServiceHolderSpec]:
    """The Weaver API client, for hosted Weaver and for NexRL's local service alike."""
    return [
        ServiceHolderSpec(
            name="weaver",
            factory="nexrl_weaver.holder:WeaverServiceHolder",
            config_class=WeaverHolderConfig,
            description="nex-weaver SDK client: sampling and training on hosted Weaver or the local service",
        )
    ]
