"""Every hook spec is documented, with its exact signature, in the plugin guide."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

from nexrl_core.plugins import hookspecs

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"
HOOKS = sorted(name for name in dir(hookspecs) if name.startswith("nexrl_"))


def test_there_are_hooks() -> None:
    assert HOOKS == [
        "nexrl_advantage_estimators",
        "nexrl_backends",
        "nexrl_group_engines",
        "nexrl_metrics_sinks",
        "nexrl_placers",
        "nexrl_policy_losses",
        "nexrl_rollout_sources",
        "nexrl_service_holders",
        "nexrl_services",
        "nexrl_tasks",
        "nexrl_trainers",
        "nexrl_transports",
    ]


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_documented_with_its_signature(hook: str) -> None:
    signature = str(inspect.signature(getattr(hookspecs, hook))).replace("'", "")
    assert f"### {hook}{signature}\n" in GUIDE.read_text()


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_has_a_docstring(hook: str) -> None:
    assert inspect.getdoc(getattr(hookspecs, hook))


DOCS = sorted([*(GUIDE.parent.glob("*.md")), GUIDE.parents[1] / "README.md"])
IMPORT_LINE = re.compile(r"^from (nexrl\w*(?:\.\w+)*) import ([\w, ]+)$", re.M)


def shown_imports() -> list[tuple[str, str, str]]:
    """Every ``from nexrl... import ...`` line the docs show, as (doc, module, name)."""
    return [
        (path.name, module, name.strip())
        for path in DOCS
        for module, names in IMPORT_LINE.findall(path.read_text())
        for name in names.split(",")
        if name.strip()
    ]


def test_the_plugin_guide_shows_imports() -> None:
    assert {doc for doc, _, _ in shown_imports()} >= {"plugins.md"}


@pytest.mark.parametrize(("doc", "module", "name"), shown_imports())
def test_every_import_the_docs_show_works(doc: str, module: str, name: str) -> None:
    """A plugin author copies these lines: each names a module and a name that exist."""
    assert hasattr(importlib.import_module(module), name), f"{doc}: `from {module} import {name}` fails"
