"""Resolve the options of components chosen by name against their registered config class.

A recipe names components (``algorithm.loss.name: ppo``) whose options belong to a
plugin, so they can only be checked once the registry says which config class the
name maps to. The registry is imported on first use, which keeps `import
nexrl_core.config` free of plugin discovery.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import attrs

from nexrl_core.config.converter import structure_config
from nexrl_core.config.errors import ConfigError
from nexrl_core.config.schema import REGISTRY_KIND, REGISTRY_LIST_KIND, ChoiceList, ComponentChoice, as_choices


def resolve_options(kind: str, choice: ComponentChoice, path: str) -> Any:
    """Structure ``choice.options`` into the config class registered for ``choice.name``.

    :param kind: registry kind, e.g. ``"policy_losses"``.
    :param path: dotted key path of the choice in the recipe (``algorithm.loss``), so
        problems read ``algorithm.loss.options.clip_low: ...``.
    :raises ConfigError: when the name is unknown or an option is invalid.
    """
    from nexrl_core.plugins.registry import UnknownComponentError, find_spec, get_registry

    if choice.name is None:
        registry = get_registry()
        known = [f"{name} (from {registry.providers[(kind, name)]})" for name in registry.names(kind)]
        raise ConfigError(
            [f"{path}.name: not set; choose one of the installed: {', '.join(known) or 'none (install a plugin that provides one)'}"]
        )
    try:
        spec = find_spec(kind, choice.name)
    except UnknownComponentError as error:
        raise ConfigError([f"{path}.name: {error}"]) from None
    return structure_config(choice.options, spec.config_class, path=f"{path}.options")


def check_recipe_with_components(config: Any, resolved: Mapping[str, Any]) -> None:
    """Ask each chosen component that checks recipes (``recipe_check`` of a `nexrl_core.plugins.specs.BackendSpec` or `nexrl_core.plugins.specs.RolloutSourceSpec`)
    about ``config``, with its options from ``resolved`` (`resolve_all_options`).

    :raises ConfigError: listing every component's problems at once.
    """
    from nexrl_core.plugins.registry import find_spec

    problems = []
    for path, kind, choice in component_choices(config):
        if path in resolved and choice.name is not None:
            recipe_problems = getattr(find_spec(kind, choice.name), "recipe_problems", None)
            if recipe_problems is not None:
                problems += recipe_problems(config, resolved[path])
    if problems:
        raise ConfigError(problems)


def component_choices(config: Any, path: str = "") -> Iterator[tuple[str, str, ComponentChoice]]:
    """Every `ComponentChoice` field inside the attrs ``config``, as (path, kind, choice)."""
    for field in attrs.fields(type(config)):
        value = getattr(config, field.name)
        field_path = f"{path}.{field.name}" if path else field.name
        if REGISTRY_KIND in field.metadata:
            yield field_path, field.metadata[REGISTRY_KIND], value
        elif attrs.has(type(value)):
            yield from component_choices(value, field_path)


def component_lists(config: Any, path: str = "") -> Iterator[tuple[str, str, ChoiceList | None]]:
    """Every `ChoiceList` field inside the attrs ``config``, as (path, kind, entries)."""
    for field in attrs.fields(type(config)):
        value = getattr(config, field.name)
        field_path = f"{path}.{field.name}" if path else field.name
        if REGISTRY_LIST_KIND in field.metadata:
            yield field_path, field.metadata[REGISTRY_LIST_KIND], value
        elif attrs.has(type(value)) and REGISTRY_KIND not in field.metadata:
            yield from component_lists(value, field_path)


@attrs.frozen
class ResolvedChoice:
    """One entry of a `ChoiceList`, its options structured into its config class."""

    name: str
    options: Any
    path: str
    """Where it came from in the recipe (``output.sinks[1]``), for messages."""


def resolve_choice_list(kind: str, entries: ChoiceList | None, path: str) -> list[ResolvedChoice]:
    """Each entry of a `ChoiceList` with its options; null takes the components of
    ``kind`` that register themselves as defaults (their spec's ``default``), by name.

    :raises ConfigError: listing every unknown name, bad option and name given twice.
    """
    from nexrl_core.plugins.registry import get_registry

    if entries is None:
        registry = get_registry()
        defaults = [name for name in registry.names(kind) if getattr(registry.find_spec(kind, name), "default", False)]
        return [ResolvedChoice(name, resolve_options(kind, ComponentChoice(name=name), path), path) for name in defaults]
    resolved = []
    problems = []
    seen: set[str] = set()
    for index, choice in enumerate(as_choices(entries)):
        entry_path = f"{path}[{index}]"
        if choice.name in seen:
            problems.append(f"{entry_path}: {choice.name!r} is listed twice; list each once")
            continue
        seen.add(choice.name or "")
        try:
            resolved.append(ResolvedChoice(choice.name or "", resolve_options(kind, choice, entry_path), entry_path))
        except ConfigError as error:
            problems += error.problems
    if problems:
        raise ConfigError(problems)
    return resolved


def resolve_all_options(config: Any, require_names: bool = True) -> dict[str, Any]:
    """Resolve every component choice in ``config``, keyed by its dotted path.

    :param require_names: whether a choice without a name is a problem (a run needs
        every component; showing a recipe does not, and leaves such a choice out).
    :raises ConfigError: listing the problems of every component at once.
    """
    resolved = {}
    problems = []
    for path, kind, choice in component_choices(config):
        if choice.name is None and not require_names:
            continue
        try:
            resolved[path] = resolve_options(kind, choice, path)
        except ConfigError as error:
            problems += error.problems
    if problems:
        raise ConfigError(problems)
    return resolved
