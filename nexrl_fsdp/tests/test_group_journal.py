"""The on-disk journal of a worker-group model: calls read back as written, per restart point."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nexrl_fsdp.group_journal import GroupJournal, ReplayCall


def forward_backward(seed: int) -> ReplayCall:
    generator = torch.Generator().manual_seed(seed)
    datums = {
        "lengths": torch.tensor([3, 2], dtype=torch.int64),
        "tokens": torch.randint(0, 100, (5,), generator=generator),
        "value:advantages": torch.randn(5, generator=generator),
    }
    return ReplayCall("forward_backward", datums, {"loss_fn": "ppo", "loss_fn_config": {"clip_low": 0.1}, "backward": True})


def optim_step(lr: float) -> ReplayCall:
    return ReplayCall("optim_step", None, {"learning_rate": lr, "beta1": 0.8})


def same(a: ReplayCall, b: ReplayCall) -> bool:
    if a.op != b.op or dict(a.options) != dict(b.options) or (a.datums is None) != (b.datums is None):
        return False
    return a.datums is None or (a.datums.keys() == b.datums.keys() and all(torch.equal(a.datums[k], b.datums[k]) for k in a.datums))


def test_calls_read_back_in_order_for_their_restart_point(tmp_path: Path) -> None:
    journal = GroupJournal(tmp_path / "journal")
    calls = [forward_backward(0), forward_backward(1), optim_step(2e-4), forward_backward(2)]
    journal.start(tmp_path / "a")
    for call in calls:
        journal.append(call)
    read = GroupJournal(tmp_path / "journal").resume(tmp_path / "a")
    assert len(read) == len(calls) and all(same(x, y) for x, y in zip(read, calls))
    assert GroupJournal(tmp_path / "journal").resume(tmp_path / "b") == []


def test_a_full_journal_reads_back_in_call_order_past_ten_calls(tmp_path: Path) -> None:
    """At the default ``--worker-save-every 10`` a journal holds up to 20 calls (10 steps
    of forward_backward and optim_step): call 10 comes after call 9, not after call 1,
    or a restarted service would replay a step's gradient after a later step."""
    journal = GroupJournal(tmp_path / "journal")
    calls = [optim_step(float(n)) for n in range(20)]
    journal.start(tmp_path / "a")
    for call in calls:
        journal.append(call)
    read = GroupJournal(tmp_path / "journal").resume(tmp_path / "a")
    assert [call.options["learning_rate"] for call in read] == [float(n) for n in range(20)]


def test_calls_before_any_restart_point_belong_to_the_initial_weights(tmp_path: Path) -> None:
    journal = GroupJournal(tmp_path / "journal")
    journal.append(optim_step(1e-3))
    (call,) = GroupJournal(tmp_path / "journal").resume(None)
    assert same(call, optim_step(1e-3))


def test_a_resumed_journal_goes_on_after_its_calls(tmp_path: Path) -> None:
    GroupJournal(tmp_path / "journal").append(forward_backward(0))
    journal = GroupJournal(tmp_path / "journal")
    assert len(journal.resume(None)) == 1
    journal.append(optim_step(1e-3))
    read = GroupJournal(tmp_path / "journal").resume(None)
    assert [call.op for call in read] == ["forward_backward", "optim_step"]


def test_the_previous_restart_points_journal_is_kept_until_the_next_one(tmp_path: Path) -> None:
    """The owner records a new restart point after the engine switched to it: killed in
    between, it rebuilds from the previous point and needs that point's journal."""
    journal = GroupJournal(tmp_path / "journal")
    journal.start(tmp_path / "a")
    journal.append(optim_step(1.0))
    journal.start(tmp_path / "b")
    journal.append(optim_step(2.0))
    assert [c.options["learning_rate"] for c in GroupJournal(tmp_path / "journal").resume(tmp_path / "a")] == [1.0]
    journal.start(tmp_path / "a")
    assert GroupJournal(tmp_path / "journal").resume(tmp_path / "a") == [], "a new point at a used path starts empty"
    assert [c.options["learning_rate"] for c in GroupJournal(tmp_path / "journal").resume(tmp_path / "b")] == [2.0]
    journal.start(tmp_path / "c")
    assert GroupJournal(tmp_path / "journal").resume(tmp_path / "b") == [], "older than the previous point is gone"


def test_an_unknown_op_is_not_a_call() -> None:
    with pytest.raises(ValueError):
        ReplayCall("save_state")
