"""Which distribution may import which: backends meet in the core, never in each other.

`ALLOWED` below is the rule, and `docs/architecture.md` shows it as its import table
(`test_the_architecture_page_shows_this_table`). The test finds every distribution by its
``pyproject.toml``, maps each top-level package (the wheel's ``packages``) to its
distribution, reads every import of every module of that package (``ast``: imports at the
top and inside functions, and ``"package.module:attr"`` strings, the lazy factories specs
name), and fails on an import the table does not allow. A distribution is a backend when
one of its ``nexrl.plugins`` entry-point modules implements ``nexrl_backends``, and its
backend modules are where the factories of the backends it registers live (the factory
module's package, e.g. ``nexrl_engine.inprocess``). No distribution imports another's
backend modules, whatever the table says; a backend imports another backend distribution
only when that one is also an engine (`nexrl-fsdp` shards `nexrl-engine`'s engine). Everything a backend needs to build and
drive a trainer (`nexrl_core.training.trainer.build_trainer`, `nexrl_core.training.holder_backend`,
`nexrl_core.training.holder_trainer`, `nexrl_core.training.self_hosted`) is in the core.

Tests of a distribution (its ``tests/``) are free to import across: they are not shipped.
"""

from __future__ import annotations

import ast
import os
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
ENTRY_POINT_GROUP = "nexrl.plugins"
BACKEND_HOOK = "nexrl_backends"
SKIPPED_DIRS = {"build", "dist", "node_modules", "__pycache__", "tests"}
FACTORY = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
"""A spec's lazy factory: ``package.module:name``."""


@attrs.frozen
class Row:
    folder: str
    """Where its pyproject.toml is, from the repository root."""
    package: str
    kind: str
    may_import: tuple[str, ...]
    holds: str


CORE = "nexrl"
PROTOCOL_LIBRARIES = ("nexrl", "nexrl-remote-api", "nexrl-service", "nexrl-engine", "nexrl-fsdp")
"""What a distribution speaking one vendor API builds on: the SDK holders' skeleton
(`nexrl-remote-api`, not its backend modules) and the local services' runtime."""
# fmt: off
ALLOWED: dict[str, Row] = {
    "nexrl": Row(
        ".", "nexrl_core", "core", (),
        "hook specs, records, config, registries, the loop, the CLI, the conformance kit, how every HTTP app starts "
        "(`nexrl_core.http.serving`), and what every backend builds on: `HolderBackend`, `build_trainer`, the trainer bases",
    ),
    "nexrl-grpo": Row(
        "plugins/nexrl_grpo", "nexrl_grpo", "algorithms", (CORE,),
        "advantage estimators, policy losses, KL, the `remote_api_grpo` and `self_hosted_grpo` trainers",
    ),
    "nexrl-remote-api": Row(
        "plugins/nexrl_remote_api", "nexrl_remote_api", "backend", (CORE,),
        "the `remote_api` backend: a registered service holder on a URL or on a local service it starts; and what "
        "every holder on a vendor SDK shares: `SdkServiceHolder`, its config and its contract tests",
    ),
    "nexrl-engine": Row(
        "plugins/nexrl_engine", "nexrl_engine", "engine, backend", (CORE,),
        "the single-device engine (sampler, losses, optimizer, LoRA, checkpoints) every local path trains on, the "
        "`inprocess` backend, and the tiny model with its `addition` task",
    ),
    "nexrl-fsdp": Row(
        "nexrl_fsdp", "nexrl_fsdp", "backend", (CORE, "nexrl-engine"),
        "FSDP ranks and worker groups, the `direct-zmq` transport and workers' API, the `self-hosted` backend",
    ),
    "nexrl-service": Row(
        "plugins/nexrl_service", "nexrl_service", "service runtime", (CORE, "nexrl-engine"),
        "the local services' runtime: SQL store, futures, scheduler, sessions, auth, the engine pool, and what every "
        "local service's tests start it with",
    ),
    "nexrl-tinker": Row(
        "nexrl_tinker", "nexrl_tinker", "holder, service", PROTOCOL_LIBRARIES,
        "what Tinker has of its own: `TinkerServiceHolder` on the `tinker` SDK, and the local Tinker-compatible service",
    ),
    "nexrl-weaver": Row(
        "nexrl_weaver", "nexrl_weaver", "holder, service", PROTOCOL_LIBRARIES,
        "what Weaver has of its own: `WeaverServiceHolder` on the `nex-weaver` SDK, and the local Weaver-compatible "
        "service",
    ),
    "nexrl-episodes": Row(
        "plugins/nexrl_episodes", "nexrl_episodes", "rollout source", (CORE,),
        "the episode server: rollouts from scripts on any machine",
    ),
    "nexrl-sinks": Row("plugins/nexrl_sinks", "nexrl_sinks", "metrics sinks", (CORE,), "TensorBoard, W&B, MLflow and Trackio sinks"),
    "nexrl-ray": Row(
        "plugins/nexrl_ray", "nexrl_ray", "placer", (CORE,),
        "the `ray` placer: each worker group's ranks on a Ray cluster, one placement group per group",
    ),
    "nexrl-math": Row("plugins/nexrl_math", "nexrl_math", "library", (), "verified math rewards an agent may call"),
    "nexrl-testing": Row(
        "plugins/nexrl_testing", "nexrl_testing", "test machinery", (CORE,),
        "this repository's own test machinery (recipe-key recording, throwaway PostgreSQL, process checks, fuzzing), "
        "never installed with `nexrl`",
    ),
    "nexrl-example-plugin": Row(
        "examples/nexrl-example-plugin", "nexrl_example_plugin", "example", (CORE,),
        "the plugin guide's example advantage estimator",
    ),
}
# fmt: on
"""distribution -> its folder and package, what kind of plugin it is, which distributions its package may
import (besides itself), and what it holds."""


@attrs.frozen
class Distribution:
    name: str
    folder: Path
    packages: tuple[str, ...]
    hooks: frozenset[str]
    """The ``nexrl_*`` hooks its entry-point modules implement."""
    backend_modules: tuple[str, ...]
    """Where the factories of the backends it registers live: each factory module's package,
    or the module itself when it sits at the top of the distribution's package."""
    requires: tuple[str, ...]
    """Its dependencies and those of its extras other than ``test``, as written."""


def _pyprojects() -> Iterator[Path]:
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(name for name in dirs if not name.startswith(".") and name not in SKIPPED_DIRS)
        if "pyproject.toml" in files:
            yield Path(folder) / "pyproject.toml"


def _hook_functions(folder: Path, module: str) -> dict[str, ast.FunctionDef]:
    path = folder / Path(*module.split(".")).with_suffix(".py")
    tree = ast.parse(path.read_text())
    return {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("nexrl_")}


def _backend_modules(hook: ast.FunctionDef) -> set[str]:
    """The backend modules named by the ``"package.module:factory"`` strings of ``hook``."""
    modules = set()
    for node in ast.walk(hook):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and FACTORY.fullmatch(node.value):
            parts = node.value.split(":")[0].split(".")
            modules.add(".".join(parts[:-1] if len(parts) > 2 else parts))
    return modules


def find_distributions() -> dict[str, Distribution]:
    found = {}
    for pyproject in _pyprojects():
        data = tomllib.loads(pyproject.read_text())
        project = data["project"]
        folder = pyproject.parent
        entry_points = project.get("entry-points", {}).get(ENTRY_POINT_GROUP, {})
        hooks: set[str] = set()
        backend_modules: set[str] = set()
        for target in entry_points.values():
            functions = _hook_functions(folder, target.split(":")[0])
            hooks |= set(functions)
            if BACKEND_HOOK in functions:
                backend_modules |= _backend_modules(functions[BACKEND_HOOK])
        extras = project.get("optional-dependencies", {})
        requires = tuple(project.get("dependencies", [])) + tuple(req for extra, reqs in extras.items() if extra != "test" for req in reqs)
        packages = tuple(data["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"])
        found[project["name"]] = Distribution(project["name"], folder, packages, frozenset(hooks), tuple(sorted(backend_modules)), requires)
    return found


DISTRIBUTIONS = find_distributions()
OWNER = {package: distribution.name for distribution in DISTRIBUTIONS.values() for package in distribution.packages}
BACKENDS = sorted(name for name, distribution in DISTRIBUTIONS.items() if BACKEND_HOOK in distribution.hooks)
ENGINES = sorted(name for name, row in ALLOWED.items() if "engine" in row.kind.split(", "))
REFERENCE = re.compile(r"(?P<top>[A-Za-z_]\w*)(\.[A-Za-z_]\w*)*(:[A-Za-z_][\w.]*)?")


def _docstrings(tree: ast.Module) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            ids |= {id(child.value) for child in body if isinstance(child, ast.Expr) and isinstance(child.value, ast.Constant)}
    return ids


def references(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) for every absolute import in ``path`` and every ``"package.module[:attr]"``
    string outside docstrings (a spec's lazy factory, a ``python -m`` target)."""
    tree = ast.parse(path.read_text())
    docstrings = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            match = REFERENCE.fullmatch(node.value)
            if match and ("." in node.value or ":" in node.value) and match["top"] in OWNER:
                yield node.lineno, node.value.split(":")[0]


def foreign_imports(name: str) -> dict[str, list[str]]:
    """Other distribution -> ``file:line module`` of each place ``name``'s packages import it."""
    distribution = DISTRIBUTIONS[name]
    found: dict[str, list[str]] = {}
    for package in distribution.packages:
        for path in sorted((distribution.folder / package).rglob("*.py")):
            for line, module in references(path):
                owner = OWNER.get(module.split(".")[0])
                if owner is not None and owner != name:
                    found.setdefault(owner, []).append(f"{path.relative_to(ROOT)}:{line} {module}")
    return found


def render_table() -> str:
    """`ALLOWED` as the Markdown table docs/architecture.md shows."""
    lines = ["| distribution | package | kind | may import | holds |", "|---|---|---|---|---|"]
    for name, row in ALLOWED.items():
        may = ", ".join(f"`{other}`" for other in row.may_import) or "nothing of ours"
        package = row.package if row.folder == "." else f"{row.folder}/{row.package}"
        lines.append(f"| `{name}` | `{package}/` | {row.kind} | {may} | {row.holds} |")
    return "\n".join(lines) + "\n"


def _requirement(text: str) -> tuple[str, frozenset[str]]:
    """A requirement's distribution name and the extras it asks for."""
    match = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[([^\]]*)\])?", text)
    assert match, text
    return match[1].lower().replace("_", "-"), frozenset(extra.strip() for extra in (match[2] or "").split(",") if extra.strip())


def reachable(name: str) -> set[str]:
    """Our distributions that installing ``name`` with all its extras (but ``test``) brings along."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo: list[tuple[str, frozenset[str] | None]] = [(name, None)]  # None: every extra
    while todo:
        current, extras = todo.pop()
        data = tomllib.loads((DISTRIBUTIONS[current].folder / "pyproject.toml").read_text())["project"]
        wanted = list(data.get("dependencies", []))
        for extra, requirements in data.get("optional-dependencies", {}).items():
            if extra != "test" and (extras is None or extra in extras):
                wanted += requirements
        for requirement in wanted:
            other, other_extras = _requirement(requirement)
            if other in DISTRIBUTIONS and (other, other_extras) not in seen:
                seen.add((other, other_extras))
                todo.append((other, other_extras))
    return {other for other, _ in seen} - {name}


def test_the_table_names_every_distribution_and_its_package() -> None:
    assert sorted(DISTRIBUTIONS) == sorted(ALLOWED), "add the new distribution to ALLOWED here and to docs/architecture.md"
    assert {name: (row.folder, (row.package,)) for name, row in ALLOWED.items()} == {
        name: (str(d.folder.relative_to(ROOT)), d.packages) for name, d in DISTRIBUTIONS.items()
    }


def test_the_backends_are_the_distributions_registering_backends() -> None:
    assert BACKENDS == ["nexrl-engine", "nexrl-fsdp", "nexrl-remote-api"]
    assert sorted(name for name, row in ALLOWED.items() if "backend" in row.kind.split(", ")) == BACKENDS
    assert {name: DISTRIBUTIONS[name].backend_modules for name in BACKENDS} == {
        "nexrl-engine": ("nexrl_engine.inprocess",),
        "nexrl-fsdp": ("nexrl_fsdp.selfhosted",),
        "nexrl-remote-api": ("nexrl_remote_api.remote_backend",),
    }


def test_the_table_lets_a_backend_import_no_other_backend_but_an_engine_and_the_core_no_plugin() -> None:
    for backend in BACKENDS:
        assert set(ALLOWED[backend].may_import) & set(BACKENDS) <= set(ENGINES) - {backend}, backend
    assert ALLOWED[CORE].may_import == ()


@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_no_distribution_imports_another_ones_backend_modules(name: str) -> None:
    crossing = {
        other: [place for place in places if any(_within(place.split()[-1], module) for module in DISTRIBUTIONS[other].backend_modules)]
        for other, places in foreign_imports(name).items()
    }
    crossing = {other: places for other, places in crossing.items() if places}
    assert crossing == {}, f"{name} imports another backend's modules (backends meet in nexrl_core): {crossing}"


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_each_distribution_imports_only_what_the_table_allows(name: str) -> None:
    allowed = set(ALLOWED[name].may_import) if name in ALLOWED else set()
    stray = {other: places for other, places in foreign_imports(name).items() if other not in allowed}
    assert stray == {}, f"{name} imports distributions the table in tests/test_distribution_imports.py does not allow: {stray}"


SERVICE_RUNTIME = "nexrl-service"
SERVICE_FACE = "nexrl_service.runtime"
"""The one module of the service runtime a protocol package may import."""
SERVICE_TEST_KIT = "nexrl_service.testing"
"""What a protocol package's own test kit (its ``testing`` module) may import besides."""
PROTOCOL_PACKAGES = sorted(name for name, row in ALLOWED.items() if SERVICE_RUNTIME in row.may_import)


def beside_the_service_face(name: str) -> list[str]:
    """The places ``name``'s packages import the service runtime other than through its face."""
    return [
        place
        for place in foreign_imports(name).get(SERVICE_RUNTIME, [])
        if (module := place.split()[-1]) != SERVICE_FACE
        and not (module == SERVICE_TEST_KIT and place.split(":")[0].endswith("/testing.py"))
    ]


@pytest.mark.parametrize("name", PROTOCOL_PACKAGES)
def test_a_protocol_package_uses_the_service_runtime_only_through_its_face(name: str) -> None:
    assert beside_the_service_face(name) == [], f"{name} must import the service runtime from {SERVICE_FACE} only (add what it needs there)"


def test_the_face_holds_the_protocol_packages_and_nothing_else_of_ours_uses_it() -> None:
    assert PROTOCOL_PACKAGES == ["nexrl-tinker", "nexrl-weaver"]
    users = {
        name
        for name in DISTRIBUTIONS
        if name != SERVICE_RUNTIME and any(place.split()[-1] == SERVICE_FACE for place in foreign_imports(name).get(SERVICE_RUNTIME, []))
    }
    assert users == set(PROTOCOL_PACKAGES)


@pytest.mark.parametrize("name", sorted(ALLOWED))
def test_what_the_table_allows_is_installed_with_the_distribution(name: str) -> None:
    missing = set(ALLOWED[name].may_import) - reachable(name)
    assert missing == set(), f"{name} may import {sorted(missing)}, which its pyproject.toml does not pull in"


def test_the_architecture_page_shows_this_table() -> None:
    assert render_table() in PAGE.read_text(), f"docs/architecture.md must hold this table verbatim:\n{render_table()}"


def test_the_reader_sees_imports_lazy_factories_and_skips_docstrings(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        '"""Mentions "nexrl_engine.engine:Engine" in a docstring."""\n'
        "import nexrl_core.types\n"
        "from . import sibling\n"
        "def f():\n"
        "    from nexrl_remote_api.remote_backend import open_remote_api\n"
        '    return "nexrl_engine.inprocess.backend:open_inprocess", "nexrl_fsdp is a word"\n'
    )
    assert sorted(references(module)) == [
        (2, "nexrl_core.types"),
        (5, "nexrl_remote_api.remote_backend"),
        (6, "nexrl_engine.inprocess.backend"),
    ]
