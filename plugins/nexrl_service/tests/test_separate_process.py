"""`LocalService(separate_process=True)`, as ``nexrl train`` embeds a service: the protocol
serves from a child process of its own, which answers, stops with its parent's `stop`
and with its parent's death, and whose failure to start is reported with its output."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from echo_service import EchoService

from nexrl_core.http.serving import ServeOptions, ServiceStartError
from nexrl_testing.processes import process_gone

TESTS = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def child_finds_the_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    """The child imports `EchoService` by its module name, as it would a protocol package."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))


def test_the_child_serves_and_stop_leaves_no_process_and_no_thread(tmp_path: Path) -> None:
    before = {t.ident for t in threading.enumerate()}
    service = EchoService(ServeOptions(port=0, data_dir=str(tmp_path), separate_process=True))
    url = service.start()
    pid = service.pid
    assert pid is not None and pid != os.getpid() and service.state is None, "the state lives in the child"
    assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
    assert httpx.get(f"{url}/api/v1/healthz", timeout=30).json()["status"] == "ok"
    with pytest.raises(RuntimeError, match="already running"):
        service.start()
    service.stop()
    service.stop()  # idempotent
    assert service.pid is None and process_gone(pid)
    leftovers = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert leftovers == [], leftovers
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/api/v1/healthz", timeout=2)
    assert (tmp_path / "echo.db").is_file() and (tmp_path / "server.log").is_file()


def test_the_child_dies_with_its_parent(tmp_path: Path) -> None:
    code = (
        "import os\n"
        "from echo_service import EchoService\n"
        "from nexrl_core.http.serving import ServeOptions\n"
        f"s = EchoService(ServeOptions(port=0, data_dir={str(tmp_path)!r}, separate_process=True))\n"
        "s.start()\n"
        "print(s.pid, flush=True)\n"
        "os._exit(0)  # no stop(): the child must notice on its own\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, check=True).stdout
    pid = int(out.split()[-1])
    deadline = time.monotonic() + 30
    while not process_gone(pid):
        assert time.monotonic() < deadline, f"the server process {pid} outlived its parent"
        time.sleep(0.1)


def test_a_start_that_cannot_work_is_refused_before_the_child_and_a_dead_child_is_reported_with_its_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model that is not there, or whose files do not parse, is refused before a process
    starts; a child that dies while starting is reported with its output."""
    missing = EchoService(ServeOptions(port=0, data_dir=str(tmp_path), model=str(tmp_path / "no-such-model"), separate_process=True))
    with pytest.raises(ServiceStartError, match="no-such-model"):
        missing.start()
    assert missing.pid is None

    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    unparsable = EchoService(ServeOptions(port=0, data_dir=str(tmp_path / "data"), model=str(broken), separate_process=True))
    with pytest.raises(ServiceStartError, match="config.json' is not a valid JSON file"):
        unparsable.start()
    assert unparsable.pid is None

    # the child imports this package first, and it cannot be imported
    shadow = tmp_path / "shadow" / "nexrl_engine"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('this child cannot start')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(shadow.parent), os.environ["PYTHONPATH"]]))
    service = EchoService(ServeOptions(port=0, data_dir=str(tmp_path / "data"), separate_process=True))
    with pytest.raises(RuntimeError, match=r"(?s)exited with status 1; last output \(.*server\.log\):\n.*this child cannot start"):
        service.start()
    assert service.pid is None
