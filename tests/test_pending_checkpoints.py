"""`PendingCheckpoints`: a finished save is recorded exactly when it is, even if a Ctrl-C
lands while it is being recorded.

`nexrl train` records a background save (the run state naming it) at the end of the step
after it; a SIGINT that arrived while that record was written lost the checkpoint, and
the run ended with "no checkpoint was saved yet" although the save was complete (seen
under load in tests/test_signals_real.py). `settle`, on the way out, must record it.
"""

from __future__ import annotations

import concurrent.futures

import pytest

from nexrl_core.run.checkpoints import CheckpointError, PendingCheckpoints


def _finished(path: str) -> concurrent.futures.Future[str]:
    future: concurrent.futures.Future[str] = concurrent.futures.Future()
    future.set_result(path)
    return future


def test_a_ctrl_c_while_a_save_is_recorded_leaves_it_for_settle() -> None:
    recorded: list[str] = []
    interrupted = []

    def record(path: str) -> None:
        if not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt  # as SIGINT's handler raises it, here while writing the run state
        recorded.append(path)

    pending = PendingCheckpoints()
    pending.add(2, _finished("step_000002"), record)
    with pytest.raises(KeyboardInterrupt):
        pending.harvest()
    assert len(pending) == 1, "the complete save is still to be recorded"
    pending.settle()
    assert recorded == ["step_000002"] and len(pending) == 0


def test_saves_are_recorded_in_step_order_and_a_failed_one_is_named_once() -> None:
    recorded: list[str] = []
    failed: concurrent.futures.Future[str] = concurrent.futures.Future()
    failed.set_exception(OSError("disk full"))
    pending = PendingCheckpoints()
    pending.add(2, _finished("step_000002"), recorded.append)
    pending.add(4, failed, recorded.append)
    pending.add(6, _finished("step_000006"), recorded.append)
    with pytest.raises(CheckpointError, match="step 4 was not written: OSError: disk full"):
        pending.harvest()
    assert recorded == ["step_000002"] and len(pending) == 1
    pending.harvest()
    assert recorded == ["step_000002", "step_000006"] and len(pending) == 0
