"""Worker groups that keep failing to start are not started again without end.

A group whose ranks fail while they start (a rank with no GPU for it, NCCL that cannot
initialise, a model that does not load) fails every later start the same way. Left
alone, each request that needs a group builds one more (27 groups in 130 s, seen on a
GPU), and a client that creates a model per attempt never hears the cause. So once
`LIMIT` starts in a row failed for the same cause, with none succeeding in between,
every later start is refused at once with that cause and the failed group's log; a
successful start (after a fix that needs no restart, e.g. a GPU freed) clears it.
"""

from __future__ import annotations

import re
import threading

__all__ = ["GroupStarts"]

LIMIT = 2
"""Starts in a row that fail for the same cause before later ones are refused."""
_LOG = re.compile(r" \(the ranks' output: ([^)]*)\)")
_GROUP = re.compile(r"'model-[^']*'")


def _cause(message: str) -> str:
    """The failure with what differs between groups (their names, their logs) left out."""
    return _GROUP.sub("'…'", _LOG.sub("", message)).strip()


class GroupStarts:
    """The causes of the last group starts that failed, in a row (thread-safe)."""

    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._cause: str | None = None
        self._message = ""
        self._count = 0

    def failed(self, error: BaseException) -> None:
        message = str(error)
        cause = _cause(message)
        with self._lock:
            self._count = self._count + 1 if cause == self._cause else 1
            self._cause, self._message = cause, message

    def succeeded(self) -> None:
        with self._lock:
            self._cause, self._message, self._count = None, "", 0

    def refusal(self) -> str | None:
        """Why no group should be started now, or None."""
        with self._lock:
            if self._count < self.limit:
                return None
            log = _LOG.search(self._message)
            where = f"; the last one's output: {log.group(1)}" if log else ""
            return (
                f"worker groups cannot start on this service: the last {self._count} failed the same way: {self._cause}{where}. "
                "Fix the cause (the service's --device, its GPUs, the model) and start the service again"
            )
