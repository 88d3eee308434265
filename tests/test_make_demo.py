"""`make demo` works when run again: the second run starts fresh and says so."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("make") is None or not (ROOT / ".venv" / "bin" / "nexrl").exists(), reason="needs make install")
def test_make_demo_twice(tmp_path: Path) -> None:
    out_dir = tmp_path / "demo"
    short = f"DEMO_ARGS=schedule.steps=2 schedule.validate_every=2 task.val_size=8 output.dir={out_dir}"
    outputs = []
    for _ in range(2):
        done = subprocess.run(["make", "-C", str(ROOT), "demo", short], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        outputs.append(done.stdout + done.stderr)
    assert "--overwrite: removed the previous run" not in outputs[0]
    assert f"--overwrite: removed the previous run in {out_dir}; starting a fresh one" in outputs[1]
    assert "done: 2 steps" in outputs[1]
    assert (out_dir / "metrics.jsonl").read_text().count('"step": 2') == 1
    (tensorboard_line,) = [line for line in outputs[1].splitlines() if line.startswith("tensorboard:")]
    executable = tensorboard_line.split()[1]
    assert subprocess.run([executable, "--version"], capture_output=True, timeout=120).returncode == 0, tensorboard_line
