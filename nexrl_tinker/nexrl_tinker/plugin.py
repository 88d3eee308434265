"""Entry-point module of nexrl-tinker: registers the ``tinker`` service.

Loaded whenever the core builds its registries (``nexrl plugins`` included), so it
imports nothing heavy: the service is named by a ``"module:attr"`` string and only
imported when ``nexrl serve tinker`` (or an embedded run) picks it.
"""

from __future__ import annotations

from nexrl_core.hookspecs import hookimpl
from nexrl_core.serving import ServeOptions
from nexrl_core.specs import ServiceHolderSpec, ServiceSpec
from nexrl_tinker.holder_config import TinkerHolderConfig


@hookimpl
def nexrl_services() -> list[ServiceSpec]:
    """The local Tinker-compatible service (TinkerCloud) on the nexrl-engine engine."""
    return [
        ServiceSpec(
            name="tinker",
            factory="nexrl_tinker.server.service:TinkerService",
            config_class=ServeOptions,
            description="Local Tinker-compatible service (SDK 0.38 wire protocol) on the nexrl-engine engine",
            capabilities=frozenset({"tinker-sdk-0.38", "training", "sampling", "lora", "full-finetune"}),
        )
    ]


@hookimpl
def nexrl_service_holders() -> list[ServiceHolderSpec]:
    """The Tinker API client, for hosted Tinker and for NexRL's local service alike."""
    return [
        ServiceHolderSpec(
            name="tinker",
            factory="nexrl_tinker.holder:TinkerServiceHolder",
            config_class=TinkerHolderConfig,
            description="Tinker SDK client: sampling and training on hosted Tinker or the local service",
        )
    ]
