"""`pip install nexrl` works from wheels built out of this repo, not only from a checkout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTIONS = [ROOT, ROOT / "plugins" / "nexrl_grpo"]


def run(*command: str | Path, cwd: Path | None = None) -> str:
    completed = subprocess.run([str(part) for part in command], capture_output=True, text=True, cwd=cwd, timeout=900)
    assert completed.returncode == 0, f"{command} failed:\n{completed.stdout}\n{completed.stderr}"
    return completed.stdout


@pytest.mark.slow
def test_fresh_venv_installs_nexrl_from_a_wheelhouse(tmp_path: Path) -> None:
    wheelhouse = tmp_path / "wheelhouse"
    for distribution in DISTRIBUTIONS:
        run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", wheelhouse, distribution)
    assert sorted(wheel.name.split("-")[0] for wheel in wheelhouse.glob("*.whl")) == ["nexrl", "nexrl_grpo"]

    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv)
    pip = venv / "bin" / "pip"
    run(pip, "install", "--quiet", "-c", ROOT / "constraints.txt", "--find-links", wheelhouse, "nexrl==0.1.0", cwd=tmp_path)

    rows = {row["name"]: row for row in json.loads(run(venv / "bin" / "nexrl", "plugins", "--json", cwd=tmp_path))}
    assert rows["grpo"]["error"] is None
    assert "grpo" in rows["grpo"]["registers"]["advantage_estimators"]
    assert "ppo" in rows["grpo"]["registers"]["policy_losses"]
    code = "import nexrl_core, nexrl_grpo; print(nexrl_core.__file__)"
    assert str(venv) in run(venv / "bin" / "python", "-c", code, cwd=tmp_path)
