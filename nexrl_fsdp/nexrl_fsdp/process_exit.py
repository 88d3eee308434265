"""How a rank or the sampler process exits once its work is done: at once.

The interpreter's finalization after ``main`` returns (torch's and transformers' modules,
their threads, gloo's state) took a rank several seconds on a loaded 2-core machine, and
every second of it counts against the 10 s in which a signal must end a whole run. Such
a process holds nothing the finalization would save: its sockets are closed and its
output is flushed here first."""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def exit_at_once(code: int = 0) -> NoReturn:
    """Flush the logs and the standard streams, then end the process with ``code``."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
