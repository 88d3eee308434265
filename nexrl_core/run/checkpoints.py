"""Checkpoints a run has asked for, recorded for ``--resume`` only once they are complete.

`nexrl_core.training.backend.Backend.save_checkpoint` returns a path, or a `concurrent.futures.Future`
of one when the backend writes in the background (the self-hosted workers write their
shards while the next step's rollouts run). ``--resume`` after a crash must only find
complete checkpoints, so the loop hands each save to `PendingCheckpoints` together with
what to record once it is done (the run state as it stood at that step), and
`PendingCheckpoints.harvest` records finished saves oldest first: a checkpoint is never
recorded before an earlier one, and never while its save is still running. A save that
failed is never recorded; its error names the step.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
from collections.abc import Callable

import attrs

__all__ = ["CheckpointError", "PendingCheckpoints", "as_future"]

logger = logging.getLogger("nexrl.train")


class CheckpointError(RuntimeError):
    """A checkpoint's save failed; the message names its step. The run state still names
    the last complete checkpoint."""

    def __init__(self, step: int, error: BaseException) -> None:
        super().__init__(
            f"the checkpoint of step {step} was not written: {type(error).__name__}: {error}; "
            "--resume continues from the last complete checkpoint"
        )
        self.step = step


def as_future(saved: str | concurrent.futures.Future[str]) -> concurrent.futures.Future[str]:
    """What `Backend.save_checkpoint` returned, as a future: a path becomes a finished one."""
    if isinstance(saved, concurrent.futures.Future):
        return saved
    done: concurrent.futures.Future[str] = concurrent.futures.Future()
    done.set_result(str(saved))
    return done


@attrs.frozen
class _Saving:
    step: int
    future: concurrent.futures.Future[str]
    record: Callable[[str], None]
    """Called with the checkpoint's path once its save has finished."""


class PendingCheckpoints:
    """Saves still running, in step order."""

    def __init__(self) -> None:
        self._saving: collections.deque[_Saving] = collections.deque()

    def __len__(self) -> int:
        return len(self._saving)

    def add(self, step: int, saved: str | concurrent.futures.Future[str], record: Callable[[str], None]) -> None:
        """Track the save of ``step``; ``record(path)`` runs once it is done (see `harvest`)."""
        self._saving.append(_Saving(step, as_future(saved), record))

    def harvest(self, wait: bool = False) -> None:
        """Record every finished save, oldest first, stopping at the first still running
        (``wait``: wait for each instead).

        :raises CheckpointError: for the oldest save that failed (later ones stay pending).
        """
        while self._saving:
            oldest = self._saving[0]
            if not wait and not oldest.future.done():
                return
            try:
                path = oldest.future.result()
            except Exception as error:  # the backend's error, whatever its type, names the step here
                self._saving.popleft()
                raise CheckpointError(oldest.step, error) from error
            # Dropped only once recorded: a Ctrl-C landing while the run state is written
            # leaves the save pending, and `settle` on the way out records it again
            # (recording is idempotent) instead of losing a complete checkpoint.
            oldest.record(str(path))
            self._saving.popleft()

    def settle(self) -> None:
        """On the way out after an error or Ctrl-C: wait for every save and record the
        complete ones; a failed one is logged with its step rather than raised, so it does
        not hide what ended the run."""
        while self._saving:
            try:
                self.harvest(wait=True)
            except CheckpointError as error:
                logger.error("%s", error)
