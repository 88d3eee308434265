"""Typed registries of everything plugins register, looked up by name.

Each kind of component has its own namespace. A name two plugins both claim is an
error that names both, and an unknown name says what is known and, for the names our
own distributions provide, which extra to install.
"""

from __future__ import annotations

import difflib
import threading
from collections.abc import Mapping
from typing import Any

import attrs

from nexrl_core.plugins.loading import LoadedPlugins, load_plugins
from nexrl_core.plugins.specs import (
    AdvantageEstimatorSpec,
    BackendSpec,
    ComponentSpec,
    GroupEngineSpec,
    MetricsSinkSpec,
    PlacerSpec,
    PolicyLossSpec,
    RolloutSourceSpec,
    ServiceHolderSpec,
    ServiceSpec,
    TaskSpec,
    TrainerSpec,
    TransportSpec,
)

KINDS: Mapping[str, type[ComponentSpec]] = {
    "advantage_estimators": AdvantageEstimatorSpec,
    "policy_losses": PolicyLossSpec,
    "trainers": TrainerSpec,
    "service_holders": ServiceHolderSpec,
    "transports": TransportSpec,
    "services": ServiceSpec,
    "placers": PlacerSpec,
    "group_engines": GroupEngineSpec,
    "tasks": TaskSpec,
    "backends": BackendSpec,
    "rollout_sources": RolloutSourceSpec,
    "metrics_sinks": MetricsSinkSpec,
}
"""Registry kind → the spec record its hook returns; the hook is ``nexrl_<kind>``."""

CORE_DISTRIBUTION = "nexrl"
"""The distribution of the core, whose extras name the plugins one can add to it."""


def install_hint(name: str) -> str | None:
    """``pip install 'nexrl[NAME]'`` when the core distribution has an extra called like
    the missing component (its extras are how optional plugins are installed), else None."""
    from importlib import metadata

    try:
        extras = metadata.metadata(CORE_DISTRIBUTION).get_all("Provides-Extra") or []
    except metadata.PackageNotFoundError:
        return None
    wanted = name.replace("_", "-").lower()
    if wanted in (extra.lower() for extra in extras):
        return f"{CORE_DISTRIBUTION}[{wanted}]"
    return None


class RegistryError(Exception):
    """A registry could not be built or a lookup failed."""


class UnknownComponentError(RegistryError, LookupError):
    """No active plugin registers the requested name."""


class DuplicateComponentError(RegistryError):
    """Two plugins register the same name for the same kind."""


@attrs.frozen
class Registry:
    """Every registered spec, by kind and name, with the plugin that provided it."""

    plugins: LoadedPlugins
    specs: Mapping[str, Mapping[str, ComponentSpec]]
    providers: Mapping[tuple[str, str], str]
    hook_errors: Mapping[str, str]
    """Plugins whose registration hook raised or returned the wrong record, with the error."""

    def names(self, kind: str) -> list[str]:
        _check_kind(kind)
        return sorted(self.specs[kind])

    def provided_by(self, plugin_name: str) -> dict[str, list[str]]:
        """What one plugin registers, by kind (every kind present, possibly empty)."""
        return {kind: sorted(name for (k, name), owner in self.providers.items() if k == kind and owner == plugin_name) for kind in KINDS}

    def find_spec(self, kind: str, name: str) -> ComponentSpec:
        _check_kind(kind)
        spec = self.specs[kind].get(name)
        if spec is None:
            raise UnknownComponentError(self._unknown_message(kind, name))
        return spec

    def _unknown_message(self, kind: str, name: str) -> str:
        singular = KINDS[kind].kind.replace("_", " ")
        known = [f"{known} (from {self.providers[(kind, known)]})" for known in self.names(kind)]
        lines = [f"unknown {singular} {name!r}; known: {', '.join(known) or 'none'}."]
        close = difflib.get_close_matches(name, self.names(kind), n=1)
        if close:
            lines.append(f"Did you mean {close[0]!r}?")
        provider = install_hint(name)
        if provider is not None:
            lines.append(f"{name!r} is provided by an extra of NexRL: pip install '{provider}'.")
        broken = [f"{info.name} ({info.error})" for info in self.plugins.infos if info.error]
        broken += [f"{plugin} ({error})" for plugin, error in self.hook_errors.items()]
        if broken:
            lines.append(f"Plugins that failed to load: {'; '.join(broken)}.")
        if self.plugins.disabled:
            lines.append(f"Disabled by NEXRL_DISABLE_PLUGINS: {', '.join(sorted(self.plugins.disabled))}.")
        return " ".join(lines)


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise RegistryError(f"unknown registry kind {kind!r}; valid kinds: {', '.join(KINDS)}")


def _collect(plugins: LoadedPlugins, kind: str, hook_errors: dict[str, str]) -> list[tuple[str, ComponentSpec]]:
    """Call one registration hook plugin by plugin, so every spec keeps its provider."""
    expected = KINDS[kind]
    caller = getattr(plugins.manager.hook, f"nexrl_{kind}")
    collected = []
    for impl in caller.get_hookimpls():
        try:
            returned = impl.function()
            specs = list(returned or [])
            wrong = [spec for spec in specs if not isinstance(spec, expected)]
            if wrong:
                raise TypeError(f"nexrl_{kind} must return {expected.__name__} records, got {type(wrong[0]).__name__}")
        except Exception as exc:  # a broken plugin is reported, never fatal
            hook_errors[impl.plugin_name] = f"{type(exc).__name__} in nexrl_{kind}: {exc}"
            continue
        collected += [(impl.plugin_name, spec) for spec in specs]
    return collected


def build_registry(plugins: LoadedPlugins) -> Registry:
    """Ask every active plugin what it registers and index it by kind and name."""
    hook_errors: dict[str, str] = {}
    specs: dict[str, dict[str, ComponentSpec]] = {kind: {} for kind in KINDS}
    providers: dict[tuple[str, str], str] = {}
    for kind in KINDS:
        for plugin_name, spec in _collect(plugins, kind, hook_errors):
            owner = providers.get((kind, spec.name))
            if owner is not None:
                raise DuplicateComponentError(
                    f"{KINDS[kind].kind.replace('_', ' ')} {spec.name!r} is registered by both plugin "
                    f"{owner!r} and plugin {plugin_name!r}; uninstall one or disable it with "
                    f"NEXRL_DISABLE_PLUGINS={plugin_name}"
                )
            specs[kind][spec.name] = spec
            providers[(kind, spec.name)] = plugin_name
    return Registry(plugins=plugins, specs=specs, providers=providers, hook_errors=hook_errors)


_lock = threading.Lock()
_default: Registry | None = None


def get_registry() -> Registry:
    """The process-wide registry over the installed plugins, built on first use."""
    global _default
    with _lock:
        if _default is None:
            _default = build_registry(load_plugins())
        return _default


def reset_registry(registry: Registry | None = None) -> None:
    """Forget the process-wide registry (or replace it), e.g. after a test registers a plugin."""
    global _default
    with _lock:
        _default = registry


def find_spec(kind: str, name: str) -> ComponentSpec:
    return get_registry().find_spec(kind, name)


def _build(kind: str, name: str, config: Any) -> Any:
    return find_spec(kind, name).build(config)


def get_advantage_estimator(name: str, config: Any = None) -> Any:
    """Build the advantage estimator registered as ``name`` (config: its attrs config class)."""
    return _build("advantage_estimators", name, config)


def get_policy_loss(name: str, config: Any = None) -> Any:
    """Build the policy loss registered as ``name``."""
    return _build("policy_losses", name, config)


def get_trainer(name: str, config: Any = None) -> Any:
    """Build the trainer registered as ``name``."""
    return _build("trainers", name, config)


def get_service_holder(name: str, config: Any = None) -> Any:
    """Build the service holder registered as ``name``."""
    return _build("service_holders", name, config)


def get_transport(name: str, config: Any = None) -> Any:
    """Build the transport registered as ``name``."""
    return _build("transports", name, config)


def get_placer(name: str, config: Any = None) -> Any:
    """Build the placer registered as ``name`` (see `nexrl_core.training.placement`)."""
    return _build("placers", name, config)
