"""The core imports, defaults and names no plugin: every backend reaches it through a hook."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nexrl_testing.recipe_key_records import RECORDS_ENV

CORE = Path(__file__).resolve().parents[1] / "nexrl_core"
SOURCES = sorted(CORE.rglob("*.py"))
PLUGIN_WORDS = re.compile(r"tinker|tml-|weaver|tensorboard|wandb|mlflow|trackio", re.IGNORECASE)


def code_without_docstrings(path: Path) -> ast.Module:
    """The module's syntax tree with every docstring (module, class, function) removed."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                node.body = body[1:] or [ast.Pass()]
        # attribute docstrings: a bare string right after an assignment
        if hasattr(node, "body") and isinstance(node.body, list):
            node.body = [
                child
                for child in node.body
                if not (isinstance(child, ast.Expr) and isinstance(child.value, ast.Constant) and isinstance(child.value.value, str))
            ] or [ast.Pass()]
    return tree


def imported_modules(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: str(path.relative_to(CORE)))
def test_core_code_imports_no_plugin(path: Path) -> None:
    foreign = sorted(
        name for name in imported_modules(code_without_docstrings(path)) if name.startswith("nexrl_") and not name.startswith("nexrl_core")
    )
    assert foreign == [], f"{path.name} imports plugin modules {foreign}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: str(path.relative_to(CORE)))
def test_core_code_names_no_plugin(path: Path) -> None:
    code = ast.unparse(code_without_docstrings(path))
    comments = [line for line in path.read_text().splitlines() if line.strip().startswith("#")]
    found = PLUGIN_WORDS.findall(code) + [word for line in comments for word in PLUGIN_WORDS.findall(line)]
    assert found == [], f"{path.name} names plugins outside docstrings: {sorted(set(found))}"


def test_the_checks_see_what_they_look_for(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text('"""Mentions Tinker in a docstring, which is fine."""\nfrom nexrl_tinker.holder import X\nKEY = "tml-x"\n')
    tree = code_without_docstrings(bad)
    assert imported_modules(tree) == {"nexrl_tinker.holder"}
    assert PLUGIN_WORDS.findall(ast.unparse(tree)) == ["tinker", "tml-"]


def test_importing_every_core_module_loads_no_plugin_module() -> None:
    modules = ["nexrl_core." + ".".join(path.relative_to(CORE).with_suffix("").parts) for path in SOURCES if path.name != "__init__.py"]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n    importlib.import_module(name)\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('nexrl_') and not m.startswith('nexrl_core'))\n"
        "assert not loaded, loaded\n"
    )
    # The recipe-key recorder is this repository's test harness, loaded into every process a
    # recording test run starts; the child runs without it so that it sees only the core.
    unrecorded = {name: value for name, value in os.environ.items() if name != RECORDS_ENV}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=unrecorded)
