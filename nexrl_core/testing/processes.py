"""Find the processes a run started, to show that none outlives it.

A test sets an environment variable to a fresh value for the command it runs; every
process that command starts (services, torchrun, worker ranks, watchdogs, rollout
clients) inherits it, so whatever still carries the value afterwards was left behind.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["processes_with"]


def processes_with(marker: str) -> list[int]:
    """Pids of this user's processes (other than this one) whose environment holds ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found
