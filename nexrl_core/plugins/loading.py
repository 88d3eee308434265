"""Plugin discovery: stevedore finds and imports plugins, pluggy calls their hooks.

Every installed distribution may declare modules in the ``nexrl.plugins`` entry-point
group; our own GRPO, Tinker, Weaver and FSDP packages use the same door as a third
party. A plugin that fails to import or declares a hook NexRL does not know is recorded
with its error and left out, so one broken plugin never takes the others down.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import os
from typing import Any

import attrs
import pluggy
from stevedore import NamedExtensionManager

from nexrl_core.plugins import hookspecs

ENTRY_POINT_GROUP = "nexrl.plugins"
DISABLE_ENV = "NEXRL_DISABLE_PLUGINS"


@attrs.frozen
class PluginInfo:
    """One entry point of the ``nexrl.plugins`` group, loaded or not."""

    name: str
    """Entry-point name; also the name the plugin is registered under in pluggy."""
    module: str
    """What the entry point points at, e.g. ``nexrl_grpo.plugin``."""
    distribution: str | None
    """The installed distribution that declares it (``None`` for in-process plugins)."""
    version: str | None
    error: str | None = None
    """Why the plugin is not active, or ``None`` when it loaded."""


@attrs.frozen
class LoadedPlugins:
    """The outcome of discovery: a hook caller over the active plugins, and every plugin seen."""

    manager: pluggy.PluginManager
    infos: tuple[PluginInfo, ...]
    disabled: frozenset[str]

    def info(self, name: str) -> PluginInfo | None:
        return next((info for info in self.infos if info.name == name), None)


def disabled_plugin_names() -> frozenset[str]:
    """Names listed in ``NEXRL_DISABLE_PLUGINS`` (comma separated)."""
    raw = os.environ.get(DISABLE_ENV, "")
    return frozenset(name.strip() for name in raw.split(",") if name.strip())


def new_plugin_manager() -> pluggy.PluginManager:
    manager = pluggy.PluginManager(hookspecs.PROJECT)
    manager.add_hookspecs(hookspecs)
    return manager


def _distribution_of(entry_point: importlib.metadata.EntryPoint) -> tuple[str | None, str | None]:
    dist = entry_point.dist
    if dist is None:
        return None, None
    return dist.metadata["Name"], dist.version


def _describe_exception(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _unknown_hook_message(manager: pluggy.PluginManager, error: pluggy.PluginValidationError) -> str:
    """Turn pluggy's message about a hook without a spec into one that names the fix."""
    known = sorted(name for name in dir(hookspecs) if name.startswith(f"{hookspecs.PROJECT}_"))
    unknown = [
        name
        for name, caller in vars(manager.hook).items()
        if isinstance(caller, pluggy.HookCaller)
        and not caller.has_spec()
        and any(impl.plugin is error.plugin for impl in caller.get_hookimpls())
    ]
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"hook {name!r} is not a NexRL hook"
        hints.append(f"{hint}; did you mean {close[0]!r}?" if close else f"{hint}; known hooks: {', '.join(known)}")
    return "; ".join(hints) or str(error)


def _drop_plugins_with_unknown_hooks(manager: pluggy.PluginManager, errors: dict[str, str]) -> None:
    """Run ``check_pending`` until it passes, unregistering each plugin it blames."""
    while True:
        try:
            manager.check_pending()
            return
        except pluggy.PluginValidationError as error:
            name = manager.get_name(error.plugin)
            assert name is not None, "check_pending blames registered plugins only"
            errors[name] = _unknown_hook_message(manager, error)
            manager.unregister(error.plugin)


def load_plugins(extra: dict[str, Any] | None = None) -> LoadedPlugins:
    """Discover, import and register every enabled plugin.

    :param extra: in-process plugins (module or object with hookimpls) by name,
        registered after the installed ones; tests use this to add a plugin without
        installing a distribution.
    """
    disabled = disabled_plugin_names()
    entry_points = {entry_point.name: entry_point for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    errors: dict[str, str] = {}

    def record_failure(_manager: Any, entry_point: importlib.metadata.EntryPoint, exc: BaseException) -> None:
        errors[entry_point.name] = _describe_exception(exc)

    extensions = NamedExtensionManager(
        ENTRY_POINT_GROUP,
        names=sorted(set(entry_points) - disabled),
        on_load_failure_callback=record_failure,
        on_missing_entrypoints_callback=lambda names: None,
    )
    manager = new_plugin_manager()
    candidates = [(extension.name, extension.plugin) for extension in extensions]
    candidates += [(name, plugin) for name, plugin in (extra or {}).items() if name not in disabled]
    for name, plugin in candidates:
        try:
            manager.register(plugin, name=name)
        except (ValueError, pluggy.PluginValidationError) as exc:
            errors[name] = _describe_exception(exc)
    _drop_plugins_with_unknown_hooks(manager, errors)

    infos = []
    for name, entry_point in sorted(entry_points.items()):
        if name in disabled:
            continue
        distribution, version = _distribution_of(entry_point)
        infos.append(PluginInfo(name, entry_point.value, distribution, version, errors.get(name)))
    for name, plugin in (extra or {}).items():
        if name not in disabled:
            module = getattr(plugin, "__name__", type(plugin).__name__)
            infos.append(PluginInfo(name, module, None, None, errors.get(name)))
    return LoadedPlugins(manager=manager, infos=tuple(infos), disabled=disabled)
