"""A Ctrl-C (or SIGTERM) that stays asked for.

`nexrl train` turns both signals into a `KeyboardInterrupt` in the main thread, wherever
it is. Python drops an exception raised while a finalizer or a weakref callback runs
("Exception ignored in ..."), so a signal that lands there would be lost and the run
would train on. The handler therefore also records the request, and the training loop
asks for it between the parts of each step (`raise_if_asked`): a lost interrupt still
ends the run within a step, before the next checkpoint starts.
"""

from __future__ import annotations

import threading

__all__ = ["ask", "forget", "raise_if_asked"]

_asked = threading.Event()


def ask() -> None:
    """Record that the run was asked to stop (a signal handler calls this, then raises)."""
    _asked.set()


def forget() -> None:
    """Start a run with no stop asked for (one process may run several, as tests do)."""
    _asked.clear()


def raise_if_asked() -> None:
    """:raises KeyboardInterrupt: when a stop was asked for since `forget`."""
    if _asked.is_set():
        raise KeyboardInterrupt
