"""``key.path=value`` overrides from the command line, applied to the raw recipe.

They are applied before structuring, so an overridden value goes through exactly the
checks a value in the file does, and a misspelled key is reported with the same hint.
Values are YAML: ``0.1`` is a float, ``true`` a bool, ``[1, 2]`` a list, ``null`` None.

Choosing another component by name (``backend.name=inprocess``) drops the options the
recipe gave the one it replaces: they belong to that component's config class. Options
for the new one follow as overrides of their own (``backend.options.device=cuda``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from nexrl_core.config.errors import ConfigError
from nexrl_core.config.yaml_loader import parse_yaml


class _BadOverride(Exception):
    """One override that cannot be applied; the message says why."""


def _set_path(raw: dict[str, Any], keys: list[str], value: Any) -> None:
    """Set ``raw[k1][k2]...[kn] = value``, creating missing mappings on the way."""
    node = raw
    for depth, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            prefix = ".".join(keys[: depth + 1])
            raise _BadOverride(f"{prefix} is {child!r}, not a mapping, so it has no key {keys[depth + 1]!r}")
        node = child
    if keys[-1] == "name" and "options" in node and node.get("name") != value:
        del node["options"]
    node[keys[-1]] = value


def _apply_one(raw: dict[str, Any], override: str) -> None:
    key_path, separator, text = override.partition("=")
    if not separator:
        raise _BadOverride("expected key.path=value, e.g. rollout.group_size=4")
    keys = key_path.strip().split(".")
    if not all(keys):
        raise _BadOverride(f"key path {key_path.strip()!r} has an empty part")
    try:
        value = parse_yaml(text)
    except yaml.YAMLError as error:
        reason = getattr(error, "problem", None) or str(error)
        raise _BadOverride(f"value {text!r} is not valid YAML ({reason})") from None
    _set_path(raw, keys, value)


def apply_overrides(raw: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of ``raw`` with every ``key.path=value`` override applied, in order.

    :raises ConfigError: listing every override that is malformed or collides with a
        value that is not a mapping.
    """
    result = copy.deepcopy(dict(raw))
    problems = []
    for override in overrides:
        try:
            _apply_one(result, override)
        except _BadOverride as bad:
            problems.append(f"override {override!r}: {bad}")
    if problems:
        raise ConfigError(problems, source="command-line overrides")
    return result
