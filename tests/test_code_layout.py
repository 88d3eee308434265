"""The code stays readable: no function of any distribution's package a reader must hold
whole over `MAX_FUNCTION_LINES` (a route table is a router per resource, a run is its
steps in functions, not one closure), and, in the service runtime and the protocol
packages on it, no two modules that import each other when they run (lazy imports
included: a lazy import only hides a circle; an annotation's ``TYPE_CHECKING`` import
runs never). Those packages' ``create_app`` once held every route (246 and 255 lines),
and Tinker's app and service modules imported each other."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 80
SKIPPED = {".venv", "build", "dist", "node_modules", "tests"}


def _packages() -> dict[str, Path]:
    """Every top-level package of the repository's distributions, by name."""
    found = {}
    for init in sorted(ROOT.rglob("__init__.py")):
        parts = init.relative_to(ROOT).parts
        if any(part in SKIPPED or part.startswith(".") for part in parts) or (init.parent.parent / "__init__.py").exists():
            continue
        found[init.parent.name] = init.parent
    return found


PACKAGES = _packages()
WITHOUT_CIRCLES = ("nexrl_service", "nexrl_tinker", "nexrl_weaver")


def modules(package: str) -> dict[str, Path]:
    """Every module of ``package`` by dotted name (a package by its ``__init__``)."""
    folder = PACKAGES[package]
    found = {}
    for path in sorted(folder.rglob("*.py")):
        parts = (package, *path.relative_to(folder).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > limit:
            yield f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"


def _run_time_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node but those under ``if TYPE_CHECKING:`` (an annotation's import runs never)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            continue
        yield node
        yield from _run_time_nodes(node)


def imported(path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that ``path`` imports when it runs, lazily or not."""
    found = set()
    for node in _run_time_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in known else node.module)
    return found & set(known)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import circle once, as the modules along it (a depth-first walk's back edges)."""
    found, state = [], dict.fromkeys(graph, 0)  # 0 unseen, 1 on the walk's path, 2 done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state[target] == 1:
                found.append([*path[path.index(target) :], target])
            elif state[target] == 0:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if state[module] == 0:
            visit(module)
    return found


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_function_of_the_package_is_longer_than_a_reader_holds(package: str) -> None:
    found = [line for path in modules(package).values() for line in long_functions(path)]
    assert found == [], f"split these into smaller functions (at most {MAX_FUNCTION_LINES} lines): {found}"


def test_every_distributions_package_is_seen() -> None:
    assert {"nexrl_core", "nexrl_engine", "nexrl_fsdp", "nexrl_service", "nexrl_tinker", "nexrl_weaver"} <= set(PACKAGES)


@pytest.mark.parametrize("package", WITHOUT_CIRCLES)
def test_no_two_modules_of_the_package_import_each_other(package: str) -> None:
    known = modules(package)
    graph = {name: imported(path, known) - {name} for name, path in known.items()}
    assert circles(graph) == [], "these modules import each other; move what both need into a third"


def test_the_checks_see_a_long_function_and_a_lazy_circle(tmp_path: Path) -> None:
    long = tmp_path / "long.py"
    long.write_text("def f():\n" + "    x = 1\n" * 80)
    assert [line.split()[-3:] for line in long_functions(long)] == [["f", "(81", "lines)"]]
    assert circles({"p.app": {"p.service"}, "p.service": {"p.app"}, "p.ids": set()}) == [["p.app", "p.service", "p.app"]]
    lazy = tmp_path / "service.py"
    lazy.write_text("if TYPE_CHECKING:\n    from p.ids import Id\ndef create_app():\n    from p.app import create_app\n")
    assert imported(lazy, {"p.app": lazy, "p.service": lazy, "p.ids": lazy}) == {"p.app"}
