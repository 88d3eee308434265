"""A pytest launcher that pays for the heavy imports once: it imports the third-party
libraries NexRL's tests load (torch, the web and database stacks, the SDKs, pytest), then runs
each pytest it is asked for in a forked child, so that child starts with them loaded.

Why: the mutation list (`tests/test_mutations.py`) starts one pytest per named test, 170
of them in CI, and each spent about 6 of its 11 CPU-seconds importing the same libraries
before its test began. It imports nothing of NexRL's own: every child imports NexRL's
modules afresh from its working directory and ``PYTHONPATH``, so a mutated module is
the one it runs.

The protocol, one JSON object a line: the caller writes ``{"cwd": ..., "args": [...],
"timeout_s": ...}`` on standard input; the launcher answers ``{"status": N}`` once the
child has ended (N: pytest's exit status, or ``-1`` if it ran past ``timeout_s``), after
killing whatever the child left running in its session. One request at a time; end of
input ends the launcher. Run as ``python preloaded_pytest.py`` with the environment the
children are to have (it is not changed between them).
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import time

PRELOADED = (
    "numpy", "torch", "safetensors", "tokenizers", "fastapi", "uvicorn", "starlette", "httpx", "requests",
    "sqlalchemy", "zmq", "yaml", "attrs", "cattrs", "pydantic", "tinker", "openai", "pytest", "_pytest.python",
    "_pytest.capture",
)  # fmt: skip
"""Third-party modules only: what is already loaded in a child is never read from the
copy under test, so nothing of NexRL's may be here."""
READ_THE_ENVIRONMENT_WHEN_IMPORTED = ("huggingface_hub", "transformers", "peft")
"""Modules that must stay out of the launcher: they read settings a test's conftest sets
(``HF_HUB_OFFLINE``) once, when imported, so a child that found them loaded would run
with the launcher's settings; under it, every Tinker test that loads a tokenizer waited
out the Hub's retries."""
TIMED_OUT = -1
POLL_S = 0.05


def preload() -> None:
    """Import `PRELOADED`.

    :raises SystemExit: when one of them brought in a module of
        `READ_THE_ENVIRONMENT_WHEN_IMPORTED`.
    """
    for name in PRELOADED:
        try:
            importlib.import_module(name)
        except ImportError:  # a distribution not installed here: its tests import it themselves
            pass
    loaded = [name for name in READ_THE_ENVIRONMENT_WHEN_IMPORTED if name in sys.modules]
    if loaded:
        raise SystemExit(f"preloaded_pytest: preloading imported {', '.join(loaded)}, which read the environment when imported")


def run_child(cwd: str, args: list[str]) -> None:
    """In the forked child: become a fresh session (its processes are killed with it),
    silence its output as the caller's ``DEVNULL`` did, and run pytest as
    ``python -m pytest`` from ``cwd`` would."""
    try:
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.chdir(cwd)
        sys.path[0] = cwd
        sys.argv = ["pytest", *args]
        import pytest

        code = int(pytest.main(args))
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        code = 3
    os._exit(code)


def wait_for(pid: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return TIMED_OUT
        time.sleep(POLL_S)


def serve() -> None:
    preload()
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run_child(request["cwd"], list(request["args"]))
        status = wait_for(pid, float(request["timeout_s"]))
        try:  # what the test left running (a service, ranks) must not slow the next one
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        print(json.dumps({"status": status}), flush=True)


if __name__ == "__main__":
    serve()
