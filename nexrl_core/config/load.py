"""Read a recipe: defaults, then the YAML file, then command-line overrides."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import yaml

from nexrl_core.config.converter import dump_config, structure_config
from nexrl_core.config.env_refs import resolve_env_refs
from nexrl_core.config.errors import ConfigError
from nexrl_core.config.overrides import apply_overrides
from nexrl_core.config.schema import TrainConfig
from nexrl_core.config.yaml_loader import parse_yaml


def _layer(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """Merge ``top`` over ``base``; mappings merge key by key, anything else replaces."""
    merged = dict(base)
    for key, value in top.items():
        below = merged.get(key)
        merged[key] = _layer(below, value) if isinstance(below, Mapping) and isinstance(value, Mapping) else value
    return merged


def _yaml_error_reason(error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error)
    return f"YAML syntax error at line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark else problem


def read_recipe(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse a recipe file into raw data; an empty file gives ``{}``.

    :raises ConfigError: naming the file when it cannot be read, is not valid YAML, or
        does not hold a mapping of sections.
    """
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(["file not found"], source=source) from None
    except OSError as error:
        raise ConfigError([f"cannot read the file: {error.strerror or error}"], source=source) from None
    try:
        raw = parse_yaml(text)
    except yaml.YAMLError as error:
        raise ConfigError([_yaml_error_reason(error)], source=source) from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        sections = ", ".join(field.name for field in attrs.fields(TrainConfig))
        raise ConfigError(
            [f"the top level must be a mapping of sections ({sections}), got a {type(raw).__name__}"],
            source=source,
        )
    return raw


def _describe_source(path: str | os.PathLike[str] | None, overrides: Sequence[str]) -> str:
    base = str(path) if path is not None else "defaults"
    return f"{base} + {len(overrides)} override{'' if len(overrides) == 1 else 's'}" if overrides else base


def load_config(path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Build a `TrainConfig` from the defaults, the recipe at ``path`` (if any) and ``overrides``.

    The file and the overrides are layered over the defaults key by key, so an override
    such as ``algorithm.loss.options.clip_low=0.1`` keeps the default loss name. The
    ``${oc.env:NAME}`` references left after the overrides are resolved before any value
    is checked (`nexrl_core.config.env_refs`), so an override can replace one whose
    variable this machine lacks.

    :raises ConfigError: listing every problem, each with its full key path.
    """
    raw = _layer(dump_config(TrainConfig()), read_recipe(path) if path is not None else {})
    raw = resolve_env_refs(apply_overrides(raw, overrides), source=_describe_source(path, overrides))
    return structure_config(_own_task_has_no_name(raw), TrainConfig, source=_describe_source(path, overrides))


def _own_task_has_no_name(raw: dict[str, Any]) -> dict[str, Any]:
    """A task given by ``task.data_path`` and ``task.agent`` is the user's own: a
    registered ``task.name`` (the quickstart's ``addition``, say) would only lend it
    unrelated held-out items, so it is dropped and shows as null in the resolved recipe."""
    task = raw.get("task")
    if isinstance(task, dict) and task.get("data_path") is not None and task.get("agent") is not None:
        return {**raw, "task": {**task, "name": None}}
    return raw
