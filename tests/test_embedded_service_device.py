"""``backend.options.device``: the device the embedded service of ``nexrl train`` runs its
engines on (``nexrl serve NAME --device``). A device this machine lacks stops the run
before step 1 with one line naming the key; ``cpu`` given explicitly is the device the
service reports. The same runs on a GPU are in test_gpu_embedded_services.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nexrl_testing.devices import absent_device

NEXRL = str(Path(sys.executable).with_name("nexrl"))  # the nexrl under test, not whichever is first on PATH
RECIPES = Path(__file__).resolve().parents[1] / "recipes"


@pytest.mark.parametrize("recipe", [None, "quickstart_weaver.yaml"], ids=["tinker", "weaver"])
def test_a_device_this_machine_lacks_stops_the_run_before_step_1(tmp_path: Path, recipe: str | None) -> None:
    device = absent_device()
    out = tmp_path / "run"
    recipe_args = [str(RECIPES / recipe)] if recipe else []
    command = [NEXRL, "train", *recipe_args, f"backend.options.device={device}", f"output.dir={out}", "--no-progress"]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert completed.returncode == 2, completed.stdout + completed.stderr
    assert "Traceback" not in completed.stderr, completed.stderr
    said = [line.strip() for line in completed.stderr.splitlines() if "backend.options.device" in line]
    assert len(said) == 1 and said[0].startswith(f"backend.options.device: '{device}' asks for "), completed.stderr
    assert not (out / "metrics.jsonl").exists(), "refused before step 1"
    assert not (out / "backend" / "service" / "server.log").exists(), "no service process was started"


@pytest.mark.slow
def test_device_cpu_given_explicitly_is_where_the_embedded_service_runs(tmp_path: Path) -> None:
    out = tmp_path / "run"
    command = [
        NEXRL, "train", "backend.options.device=cpu", "schedule.steps=1", "schedule.validate_every=0",
        "rollout.prompts_per_step=4", "rollout.group_size=4", f"output.dir={out}", "--no-progress",
    ]  # fmt: skip
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert (row["backend/device"], row["backend/dtype"]) == ("cpu", "float32"), "the service says where it runs"
