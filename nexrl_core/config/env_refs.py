"""Environment references in a recipe: ``${oc.env:NAME}`` and ``${oc.env:NAME,default}``.

The spelling is OmegaConf's, so a value taken from a NexRL v1 recipe keeps working here:
a data path under ``${oc.env:NEXRL_DATA_PATH}``, a workers URL around
``${oc.env:API_SERVER_URL}``. `nexrl_core.config.load.load_config` resolves them when
the recipe is read, before any value is checked, so each reaches its check as the run
will see it; a variable that is unset and has no default is a `ConfigError` naming the
key and the variable. A value that is exactly one reference is read as YAML, as a
command-line override is (``${oc.env:STEPS,10}`` is the integer 10); a reference inside
a longer string is replaced by the variable's text. ``\\${`` is a literal ``${``.
Nothing else in ``${...}`` is touched: it is no reference of ours.

A secret belongs in the environment and out of the recipe: a key a backend needs is named
by the variable that holds it (``backend.options.api_key_env``), never written as a value.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import attrs
import yaml

from nexrl_core.config.errors import ConfigError
from nexrl_core.config.yaml_loader import parse_yaml

ENV_REF = re.compile(r"(?<!\\)\$\{oc\.env:(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:,(?P<default>[^{}]*))?\}")
"""``${oc.env:NAME}`` or ``${oc.env:NAME,default}``, not preceded by a backslash."""
ESCAPED = "\\${"


@attrs.frozen
class EnvRef:
    """One reference: the variable's name and the text used when it is unset (None: none)."""

    name: str
    default: str | None

    @classmethod
    def from_match(cls, match: re.Match[str]) -> EnvRef:
        default = match.group("default")
        return cls(match.group("name"), None if default is None else _unquote(default.strip()))

    def value(self, environ: Mapping[str, str]) -> str | None:
        """The variable's text, else the default; None when both are missing."""
        return environ.get(self.name, self.default)


def _unquote(text: str) -> str:
    """OmegaConf lets a default be quoted (``'a,b'``); the quotes are not part of it."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def env_refs(text: str) -> list[EnvRef]:
    """The references in ``text``, in order."""
    return [EnvRef.from_match(match) for match in ENV_REF.finditer(text)]


def is_single_ref(text: str) -> bool:
    """Whether ``text`` is one reference and nothing else (its value is then read as YAML)."""
    match = ENV_REF.fullmatch(text.strip())
    return match is not None


class _Unset(Exception):
    """A referenced variable is unset and its reference has no default."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def _resolve_text(text: str, environ: Mapping[str, str]) -> Any:
    def substitute(match: re.Match[str]) -> str:
        ref = EnvRef.from_match(match)
        value = ref.value(environ)
        if value is None:
            raise _Unset(ref.name)
        return value

    if is_single_ref(text):
        resolved = substitute(ENV_REF.fullmatch(text.strip()))  # type: ignore[arg-type]
        try:
            return parse_yaml(resolved) if resolved.strip() else resolved
        except yaml.YAMLError:
            return resolved
    return ENV_REF.sub(substitute, text).replace(ESCAPED, "${")


def resolve_env_refs(raw: Any, *, source: str | None = None, environ: Mapping[str, str] | None = None) -> Any:
    """``raw`` with every environment reference in its strings resolved.

    :raises ConfigError: naming each key whose variable is unset and has no default.
    """
    env = os.environ if environ is None else environ
    problems: list[str] = []

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, dict):
            return {key: walk(value, f"{path}.{key}" if path else str(key)) for key, value in node.items()}
        if isinstance(node, list):
            return [walk(value, f"{path}[{index}]") for index, value in enumerate(node)]
        if isinstance(node, str) and ("${oc.env:" in node or ESCAPED in node):
            try:
                return _resolve_text(node, env)
            except _Unset as unset:
                problems.append(
                    f"{path}: environment variable {unset.name} is not set and {node!r} gives no default "
                    f"(export {unset.name}, or write ${{oc.env:{unset.name},DEFAULT}})"
                )
                return node
        return node

    resolved = walk(raw, "")
    if problems:
        raise ConfigError(problems, source=source)
    return resolved
