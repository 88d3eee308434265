"""`pip install nexrl`, `pip install nexrl[tinker]` and `pip install nexrl[weaver]` work from wheels built out of this
repo, not only from an editable checkout; the `nexrl` wheel ships the conformance kit and none of this
repository's own test machinery (`nexrl-testing`)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTIONS = [
    ROOT,
    ROOT / "plugins" / "nexrl_grpo",
    ROOT / "plugins" / "nexrl_remote_api",
    ROOT / "plugins" / "nexrl_engine",
    ROOT / "nexrl_fsdp",
    ROOT / "plugins" / "nexrl_service",
    ROOT / "nexrl_tinker",
    ROOT / "nexrl_weaver",
    ROOT / "plugins" / "nexrl_episodes",
    ROOT / "plugins" / "nexrl_sinks",
]


def run(*command: str | Path, cwd: Path | None = None) -> str:
    completed = subprocess.run([str(part) for part in command], capture_output=True, text=True, cwd=cwd, timeout=900)
    assert completed.returncode == 0, f"{command} failed:\n{completed.stdout}\n{completed.stderr}"
    return completed.stdout


def plugin_rows(venv: Path, cwd: Path) -> dict[str, dict]:
    return {row["name"]: row for row in json.loads(run(venv / "bin" / "nexrl", "plugins", "--json", cwd=cwd))}


@pytest.mark.slow
def test_fresh_venv_installs_nexrl_then_the_tinker_and_weaver_extras_from_a_wheelhouse(tmp_path: Path) -> None:
    wheelhouse = tmp_path / "wheelhouse"
    for distribution in DISTRIBUTIONS:
        run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", wheelhouse, distribution)
    assert sorted(wheel.name.split("-")[0] for wheel in wheelhouse.glob("*.whl")) == [
        "nexrl",
        "nexrl_engine",
        "nexrl_episodes",
        "nexrl_fsdp",
        "nexrl_grpo",
        "nexrl_remote_api",
        "nexrl_service",
        "nexrl_sinks",
        "nexrl_tinker",
        "nexrl_weaver",
    ]
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv)
    # --no-compile: what is checked is what installs and registers; byte-compiling torch's
    # files on each install was a third of the test's time.
    install = [venv / "bin" / "pip", "install", "--quiet", "--no-compile", "-c", ROOT / "constraints.txt", "--find-links", wheelhouse]

    run(*install, "nexrl==0.1.0", cwd=tmp_path)
    rows = plugin_rows(venv, tmp_path)
    assert set(rows) == {"core", "grpo", "remote_api", "tensorboard", "wandb", "mlflow", "trackio"}
    assert rows["tensorboard"]["registers"]["metrics_sinks"] == ["tensorboard"]
    assert all(rows[sink]["error"] is None for sink in ("tensorboard", "wandb", "mlflow", "trackio")), "no tracker SDK needed to list them"
    assert rows["remote_api"]["registers"]["backends"] == ["remote_api"]
    assert rows["core"]["registers"]["rollout_sources"] == ["threads"]
    assert rows["grpo"]["error"] is None
    assert "grpo" in rows["grpo"]["registers"]["advantage_estimators"]
    assert "ppo" in rows["grpo"]["registers"]["policy_losses"]
    code = "import nexrl_core, nexrl_grpo; print(nexrl_core.__file__)"
    assert str(venv) in run(venv / "bin" / "python", "-c", code, cwd=tmp_path)

    run(*install, "nexrl[inprocess]==0.1.0", cwd=tmp_path)
    rows = plugin_rows(venv, tmp_path)
    assert {hook: names for hook, names in rows["engine"]["registers"].items() if names} == {
        "backends": ["inprocess"],
        "tasks": ["addition"],
    }
    assert "fsdp" not in rows, "the in-process backend installs the engine, not the FSDP side"
    code = "import importlib.util; print(importlib.util.find_spec('nexrl_fsdp'), importlib.util.find_spec('zmq'))"
    assert run(venv / "bin" / "python", "-c", code, cwd=tmp_path).split() == ["None", "None"]

    run(*install, "nexrl[tinker]==0.1.0", cwd=tmp_path)
    rows = plugin_rows(venv, tmp_path)
    assert rows["tinker"]["registers"]["service_holders"] == ["tinker"]
    assert rows["tinker"]["registers"]["services"] == ["tinker"]
    assert rows["engine"]["registers"]["tasks"] == ["addition"]
    assert rows["fsdp"]["registers"]["backends"] == ["self-hosted"]
    assert all(row["error"] is None for row in rows.values())
    code = "from nexrl_engine.loading import resolve_model_dir; print(resolve_model_dir('nexrl-tiny'))"
    model_dir = Path(run(venv / "bin" / "python", "-c", code, cwd=tmp_path).strip())
    assert str(venv) in str(model_dir)
    assert (model_dir / "model.safetensors").stat().st_size > 1_000_000

    run(*install, "nexrl[weaver]==0.1.0", cwd=tmp_path)
    rows = plugin_rows(venv, tmp_path)
    assert rows["weaver"]["registers"]["service_holders"] == ["weaver"]
    assert rows["weaver"]["registers"]["services"] == ["weaver"]
    assert all(row["error"] is None for row in rows.values())
    code = "import torch, weaver, nexrl_weaver.server.app; print(torch.__version__)"
    assert run(venv / "bin" / "python", "-c", code, cwd=tmp_path).strip() == "2.13.0+cpu"
    run(*install, "nexrl[episodes]==0.1.0", cwd=tmp_path)
    rows = plugin_rows(venv, tmp_path)
    assert rows["episodes"]["registers"]["rollout_sources"] == ["episodes"]
    assert rows["episodes"]["error"] is None
    run(venv / "bin" / "python", "-c", "from nexrl_episodes import EpisodeClient", cwd=tmp_path)


KIT = {
    "__init__.py", "advantage_contract.py", "aggregation_cases.py", "backend_contract.py", "hf_model.py", "holder_contract.py",
    "loss_contract.py", "loss_option_contract.py", "pytest_plugin.py", "rollouts.py", "toolcall_contract.py", "transport_contract.py",
}  # fmt: skip
"""What ``nexrl_core/testing/`` of the published wheel holds: the conformance kit plugin
authors subclass, the records its contracts use, and the pytest plugin with the
``register_nexrl_plugin`` fixture docs/plugins.md shows."""


def _decorated_as_fixture(node: ast.FunctionDef) -> bool:
    return any("fixture" in ast.unparse(decorator) for decorator in node.decorator_list)


def test_the_nexrl_wheel_holds_the_conformance_kit_and_none_of_the_repositorys_test_machinery(tmp_path: Path) -> None:
    run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", tmp_path, ROOT)
    (wheel,) = tmp_path.glob("nexrl-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        testing = {name.removeprefix("nexrl_core/testing/") for name in names if name.startswith("nexrl_core/testing/")}
        assert testing == KIT
        assert not [name for name in names if "sitecustomize" in name or "postgres" in name]
        (entry_points,) = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
        pytest_plugins = archive.read(entry_points).decode().partition("[pytest11]")[2].split("[")[0].split()
        assert pytest_plugins == ["nexrl", "=", "nexrl_core.testing.pytest_plugin"]
        (metadata,) = [name for name in names if name.endswith(".dist-info/METADATA")]
        requires = [line for line in archive.read(metadata).decode().splitlines() if line.startswith("Requires-Dist: nexrl-testing")]
        assert requires and all("extra == 'test'" in line or 'extra == "test"' in line for line in requires)
        plugin = ast.parse(archive.read("nexrl_core/testing/pytest_plugin.py").decode())
    functions = [node for node in plugin.body if isinstance(node, ast.FunctionDef)]
    assert [node.name for node in functions if _decorated_as_fixture(node)] == ["register_nexrl_plugin"]
    assert [node.name for node in functions if node.name.startswith("pytest_")] == ["pytest_configure"]
