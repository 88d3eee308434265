"""The README's "The trained model" section: its Python snippet runs as written on an
exported directory, and its commands are ones `nexrl export` accepts.

The snippet comes out of the README itself, so the section cannot drift from what works.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from nexrl_core.cli import cli

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"```(\w+)\n(.*?)```", re.S)


def section() -> str:
    text = README.read_text()
    start = text.index("## The trained model")
    return text[start : text.index("\n## ", start + 1)]


def test_the_snippet_loads_an_export_with_plain_transformers(tmp_path: Path) -> None:
    from nexrl_engine.engine import Engine

    (snippet,) = [body for kind, body in BLOCK.findall(section()) if kind == "python"]
    assert snippet.startswith("# use_model.py")
    Engine(model="nexrl-tiny").export_hf(tmp_path / "runs" / "quickstart" / "final_model")
    (tmp_path / "use_model.py").write_text(snippet)
    done = subprocess.run([sys.executable, "use_model.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip(), "the snippet prints the model's reply"


def test_the_export_commands_parse(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """Every option parses: without the run, each stops at the missing directory (a bad
    option would stop earlier, with status 2)."""
    monkeypatch.chdir(tmp_path)
    commands = [body for kind, body in BLOCK.findall(section()) if kind == "bash"][0]  # the run-directory ones
    for line in commands.strip().splitlines():
        argv = shlex.split(line.split("#")[0])
        assert Path(argv[0]).name == "nexrl" and argv[1] == "export"
        result = CliRunner().invoke(cli, argv[1:])
        assert result.exit_code == 1 and "runs/quickstart does not exist" in result.output, result.output
