"""YAML parsing shared by recipe files and ``key=value`` overrides.

PyYAML follows YAML 1.1, where ``1e-4`` (no dot) is a string, not a float: a learning
rate written the way everyone writes it would then fail the float check. This loader
adds the YAML 1.2 float forms and is otherwise ``yaml.SafeLoader``.
"""

from __future__ import annotations

import re
from typing import Any

import yaml


class RecipeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that also reads ``1e-4`` and ``5E+3`` as floats."""


RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_yaml(text: str) -> Any:
    """Parse one YAML document safely; raises `yaml.YAMLError` on bad syntax."""
    return yaml.load(text, Loader=RecipeLoader)
