"""`protocol_hooks`: the entry-point hooks of a distribution that speaks one vendor API.

Such a distribution (Tinker, Weaver) registers the same two things under the API's name:
NexRL's local service speaking the API's wire protocol, and the holder on the API's SDK,
each named by a lazy ``"module:attr"`` factory. Their specs and the two hook
implementations are written once here; its ``plugin`` module names what is its own.
Light to import, like every entry-point module.
"""

from __future__ import annotations

from collections.abc import Callable

from nexrl_core.http.serving import ServeOptions
from nexrl_core.plugins.hookspecs import hookimpl
from nexrl_core.plugins.specs import ServiceHolderSpec, ServiceSpec

__all__ = ["LOCAL_SERVICE_CAPABILITIES", "protocol_hooks"]

LOCAL_SERVICE_CAPABILITIES = frozenset({"training", "sampling", "lora", "full-finetune"})
"""What every NexRL local service does, whatever wire protocol it speaks."""


def protocol_hooks(
    name: str,
    *,
    service: str,
    service_description: str,
    wire: str,
    holder: str,
    holder_config: type,
    holder_description: str,
) -> tuple[Callable[[], list[ServiceSpec]], Callable[[], list[ServiceHolderSpec]]]:
    """The ``nexrl_services`` and ``nexrl_service_holders`` hook implementations that
    register, as ``name``, the local service ``service`` (a `LocalService` factory taking
    `ServeOptions`; ``wire`` is the capability naming its protocol and SDK version) and the
    holder ``holder`` with its config class. Bind them under those names in the
    entry-point module: pluggy finds hooks by attribute name."""
    service_spec = ServiceSpec(
        name=name,
        factory=service,
        config_class=ServeOptions,
        description=service_description,
        capabilities=frozenset({wire}) | LOCAL_SERVICE_CAPABILITIES,
    )
    holder_spec = ServiceHolderSpec(name=name, factory=holder, config_class=holder_config, description=holder_description)

    @hookimpl
    def nexrl_services() -> list[ServiceSpec]:
        return [service_spec]

    @hookimpl
    def nexrl_service_holders() -> list[ServiceHolderSpec]:
        return [holder_spec]

    return nexrl_services, nexrl_service_holders
