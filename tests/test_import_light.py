"""`import nexrl_core`, the CLI and plugin discovery stay free of heavy imports."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "numpy", "zmq", "fastapi", "uvicorn", "tinker", "weaver", "transformers", "pyarrow", "datasets")


def modules_after(code: str) -> set[str]:
    script = f"{code}\nimport sys\nprint('\\n'.join(sys.modules))"
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    return {name.split(".")[0] for name in completed.stdout.split()}


def test_import_nexrl_core_is_light() -> None:
    assert not modules_after("import nexrl_core") & set(HEAVY)


def test_reading_a_jsonl_task_is_light(tmp_path) -> None:
    """pyarrow and datasets load only for the files that need them."""
    data = tmp_path / "items.jsonl"
    data.write_text('{"a": 1}\n')
    code = f"from nexrl_core.run.data_files import read_rows\nread_rows({str(data)!r}, 'task.data_path', None)"
    assert not modules_after(code) & set(HEAVY)


def test_loading_every_plugin_and_the_cli_is_light() -> None:
    loaded = modules_after("import nexrl_core.cli\nfrom nexrl_core.plugins.registry import get_registry\nget_registry()")
    assert not loaded & set(HEAVY)
