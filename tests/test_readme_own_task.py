"""The README's "Train on your own task" section runs as written and the held-out reward rises.

The files and commands come out of the README itself (each file's block starts with a
``# <name>`` comment), so the section cannot drift from what works.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"```(\w+)\n(.*?)```", re.S)


def own_task_section() -> str:
    text = README.read_text()
    start = text.index("## Train on your own task")
    return text[start : text.index("\n## ", start + 1)]


def test_the_section_has_its_files_and_commands() -> None:
    blocks = BLOCK.findall(own_task_section())
    names = [body.splitlines()[0].split(":")[0].lstrip("# ").strip() for kind, body in blocks if kind != "bash"]
    assert names == ["make_data.py", "my_agent.py", "my_task.yaml"]
    assert [kind for kind, _ in blocks][-1] == "bash"


@pytest.mark.slow
def test_the_readme_snippet_trains(tmp_path: Path) -> None:
    blocks = BLOCK.findall(own_task_section())
    for kind, body in blocks:
        if kind != "bash":
            (tmp_path / body.splitlines()[0].split(":")[0].lstrip("# ").strip()).write_text(body)
    bin_dir = Path(sys.executable).parent
    (commands,) = [body for kind, body in blocks if kind == "bash"]
    for line in commands.strip().splitlines():
        argv = shlex.split(line)
        argv[0] = str(bin_dir / Path(argv[0]).name)
        done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{line}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    rows = [json.loads(line) for line in (tmp_path / "runs" / "latest" / "metrics.jsonl").read_text().splitlines()]
    val = [row["val/reward/mean"] for row in rows if "val/reward/mean" in row]
    assert val[-1] > val[0] + 0.2, val
