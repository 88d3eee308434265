"""Read a NexRL v1 recipe as Hydra and OmegaConf composed it, without either installed.

v1 recipes rely on a small part of Hydra 1.3 and OmegaConf 2.3, and this module does
that part and refuses the rest by name, so a recipe is either read as v1 read it or not
at all:

- a ``defaults:`` list of config names (``common``) and group choices
  (``trainer: self_hosted``, read from ``trainer/self_hosted.yaml`` into the key
  ``trainer``), found relative to the folder of the file that lists them, with
  ``_self_`` marking where that file's own keys merge (at the end when absent, as in
  Hydra 1.1 and later), ``optional`` choices that may be missing, and ``null`` choices
  that load nothing;
- merging as OmegaConf does: mappings key by key, anything else (lists included) replaced;
- ``${a.b}`` and relative ``${.b}`` / ``${..b}`` interpolations, whole values keeping their
  type and parts of a string turned into text;
- ``${oc.env:NAME}`` and ``${oc.env:NAME,default}`` are kept as written: NexRL's recipe
  loader resolves them when the run starts (`nexrl_core.config.env_refs`), so a key
  held in the environment never becomes a value in a converted recipe.

YAML is read with the safe loader only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from nexrl_core.config.env_refs import ENV_REF
from nexrl_core.config.yaml_loader import parse_yaml

SELF = "_self_"
MISSING = "???"
"""OmegaConf's mandatory value that a recipe has not set."""

_INTERPOLATION = re.compile(r"(?<!\\)\$\{([^${}]*)\}")
_KEY = re.compile(r"^(\.*)([A-Za-z0-9_\-]+(?:\.[A-Za-z0-9_\-]+)*)?$")


class V1RecipeError(ValueError):
    """A v1 recipe that cannot be read as v1 read it; the message names the file and key."""


def _merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in top.items():
        below = merged.get(key)
        merged[key] = _merge(below, value) if isinstance(below, Mapping) and isinstance(value, Mapping) else value
    return merged


def _read(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise V1RecipeError(f"{path}: cannot read it ({error.strerror or error})") from None
    if any(line.strip().startswith("# @package") for line in text.splitlines()):
        raise V1RecipeError(f"{path}: a '# @package' header is not supported; move its keys to where they belong and remove it")
    try:
        data = parse_yaml(text)
    except yaml.YAMLError as error:
        raise V1RecipeError(f"{path}: not valid YAML ({getattr(error, 'problem', None) or error})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise V1RecipeError(f"{path}: the top level must be a mapping, got a {type(data).__name__}")
    return data


def _entry(entry: Any, where: Path) -> tuple[str | None, str | None, bool]:
    """A defaults-list entry as (group or None, config name or None for ``null``, optional)."""
    if isinstance(entry, str):
        return None, entry, False
    if isinstance(entry, dict) and len(entry) == 1:
        ((key, value),) = entry.items()
        words = str(key).split()
        optional = words[:1] == ["optional"]
        group = words[-1]
        if len(words) > 2 or (len(words) == 2 and not optional) or "@" in group or group.startswith("/"):
            raise V1RecipeError(
                f"{where}: defaults entry {entry!r} is not supported (only 'name', 'group: name' and 'optional group: name')"
            )
        if value is not None and not isinstance(value, str):
            raise V1RecipeError(f"{where}: defaults entry {entry!r} chooses {value!r}, not a config name")
        return group, value, optional
    raise V1RecipeError(f"{where}: defaults entry {entry!r} is not supported (only 'name', 'group: name' and 'optional group: name')")


def _at(package: str, data: dict[str, Any]) -> dict[str, Any]:
    for part in reversed([part for part in package.split("/") if part]):
        data = {part: data}
    return data


def compose(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The recipe at ``path`` with its ``defaults:`` list composed (interpolations left as written).

    :raises V1RecipeError: for a missing file, a cycle, or a defaults entry this reader does not support.
    """
    path = Path(path).resolve()
    if path in _seen:
        raise V1RecipeError(f"{path}: its defaults list includes itself ({' -> '.join(str(p) for p in (*_seen, path))})")
    own = _read(path)
    defaults = own.pop("defaults", [])
    if not isinstance(defaults, list):
        raise V1RecipeError(f"{path}: defaults must be a list, got {defaults!r}")
    if SELF not in defaults:
        defaults = [*defaults, SELF]
    composed: dict[str, Any] = {}
    for entry in defaults:
        if entry == SELF:
            composed = _merge(composed, own)
            continue
        group, name, optional = _entry(entry, path)
        if name is None:
            continue
        relative = f"{group}/{name}" if group else name
        target = path.parent / f"{relative}.yaml"
        if not target.exists():
            if optional:
                continue
            raise V1RecipeError(f"{path}: defaults entry {entry!r} names {target}, which does not exist")
        package = group if group is not None else "/".join(Path(name).parts[:-1])  # Hydra's _group_ package
        composed = _merge(composed, _at(package, compose(target, (*_seen, path))))
    return composed


def _lookup(root: dict[str, Any], key_path: list[str], reference: str, where: str) -> Any:
    node: Any = root
    for part in key_path:
        if not isinstance(node, dict) or part not in node:
            raise V1RecipeError(f"{where}: ${{{reference}}} names a key the recipe does not have")
        node = node[part]
    return node


def _target(reference: str, where: list[str]) -> list[str]:
    """The absolute key path of ``${reference}`` written at ``where``."""
    match = _KEY.fullmatch(reference.strip())
    if match is None or not (match.group(1) or match.group(2)):
        raise V1RecipeError(f"{'.'.join(where)}: ${{{reference}}} is not supported (only ${{a.b}}, ${{.b}} and ${{oc.env:NAME[,default]}})")
    dots, rest = match.group(1), match.group(2) or ""
    parts = rest.split(".") if rest else []
    if not dots:
        return parts
    base = where[:-1]
    up = len(dots) - 1
    if up > len(base):
        raise V1RecipeError(f"{'.'.join(where)}: ${{{reference}}} climbs above the top of the recipe")
    return base[: len(base) - up] + parts


def resolve(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with every ``${a.b}`` interpolation replaced by what it names; environment
    references are kept as written.

    :raises V1RecipeError: naming the key of an interpolation that names no key, loops, or
        uses a resolver other than ``oc.env``.
    """
    done: dict[tuple[str, ...], Any] = {}

    def value_at(path: list[str], stack: tuple[tuple[str, ...], ...], written_at: str) -> Any:
        key = tuple(path)
        if key in done:
            return done[key]
        if key in stack:
            chain = " -> ".join(".".join(step) for step in (*stack, key))
            raise V1RecipeError(f"interpolation loop: {chain}")
        raw = _lookup(config, path, ".".join(path), written_at)
        value = walk(raw, path, (*stack, key))
        done[key] = value
        return value

    def text(value: Any, where: list[str]) -> str:
        if isinstance(value, (dict, list)):
            raise V1RecipeError(f"{'.'.join(where)}: an interpolation inside a string names a mapping or list")
        return str(value)

    def interpolate(raw: str, where: list[str], stack: tuple[tuple[str, ...], ...]) -> Any:
        matches = list(_INTERPOLATION.finditer(raw))
        whole = len(matches) == 1 and matches[0].span() == (0, len(raw))
        pieces: list[str] = []
        last = 0
        for match in matches:
            reference = match.group(1)
            pieces.append(raw[last : match.start()])
            last = match.end()
            if ENV_REF.fullmatch(match.group(0)):
                pieces.append(match.group(0))
                continue
            if ":" in reference.split(".")[0] or reference.strip().startswith(("oc.", "hydra:")):
                raise V1RecipeError(
                    f"{'.'.join(where)}: ${{{reference}}} uses a resolver; only ${{oc.env:NAME}} and ${{oc.env:NAME,default}} are read"
                )
            target = value_at(_target(reference, where), stack, ".".join(where))
            if whole:
                return target
            pieces.append(text(target, where))
        pieces.append(raw[last:])
        return "".join(pieces)

    def walk(node: Any, path: list[str], stack: tuple[tuple[str, ...], ...]) -> Any:
        if isinstance(node, dict):
            return {key: walk(value, [*path, str(key)], stack) for key, value in node.items()}
        if isinstance(node, list):
            return [walk(item, [*path, str(index)], stack) for index, item in enumerate(node)]
        if isinstance(node, str) and "${" in node:
            return interpolate(node, path, stack)
        return node

    interpolated: dict[str, Any] = walk(config, [], ())
    return interpolated


def read_v1_recipe(path: str | Path) -> dict[str, Any]:
    """The v1 recipe at ``path``, composed and with its interpolations resolved."""
    return resolve(compose(path))
