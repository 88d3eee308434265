"""The runtime installs and runs without nexrl-fsdp: it gets worker groups only through the
core's seam (`nexrl_core.training.worker_groups`), and a service asked for ``--workers N`` with no
plugin providing them refuses at start in one line naming the extra that brings them."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nexrl_service"
MODULES = sorted(PACKAGE.rglob("*.py"))

_WITHOUT_FSDP = """
import importlib, pkgutil, sys

class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name == "nexrl_fsdp" or name.startswith("nexrl_fsdp."):
            raise ImportError(f"{name} is not installed here")

sys.meta_path.insert(0, Blocked())
import nexrl_service
for module in pkgutil.walk_packages(nexrl_service.__path__, "nexrl_service."):
    importlib.import_module(module.name)

from nexrl_core.http.serving import ServeOptions, ServiceStartError
from nexrl_service.settings import ServerSettings
from nexrl_service.state import _group_limits

assert _group_limits(ServerSettings.from_options(ServeOptions(data_dir=sys.argv[1]), "test")) is None
try:
    _group_limits(ServerSettings.from_options(ServeOptions(data_dir=sys.argv[1], workers=2), "test"))
except ServiceStartError as error:
    print(error)
    assert error.option == "workers", error.option
else:
    raise SystemExit("a service with --workers 2 and nothing that provides worker groups started")
assert not [name for name in sys.modules if name.startswith("nexrl_fsdp")]
"""


def _imported(path: Path) -> set[str]:
    """Every module ``path`` imports (at the top or inside functions) or names as a
    ``"package.module:attr"`` factory."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and ":" in node.value:
            names.add(node.value.split(":")[0])
    return names


@pytest.mark.parametrize("path", MODULES, ids=lambda path: path.name)
def test_no_module_of_the_runtime_imports_nexrl_fsdp(path: Path) -> None:
    fsdp = sorted(name for name in _imported(path) if name == "nexrl_fsdp" or name.startswith("nexrl_fsdp."))
    assert fsdp == [], f"{path.name} imports {fsdp}: ask nexrl_core.training.worker_groups instead"


def test_without_a_worker_group_plugin_workers_are_refused_at_start_naming_the_extra(tmp_path: Path) -> None:
    env = {**os.environ, "NEXRL_DISABLE_PLUGINS": "fsdp"}
    done = subprocess.run([sys.executable, "-c", _WITHOUT_FSDP, str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = done.stdout.splitlines()
    assert line.startswith("--workers 2 trains each model on a worker group, but no installed plugin provides worker groups"), line
    assert "disabled by NEXRL_DISABLE_PLUGINS: fsdp" in line, line
    assert line.endswith("; pip install 'nexrl-service[workers]' brings them"), line
