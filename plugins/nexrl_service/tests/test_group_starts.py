"""`GroupStarts`: worker groups that keep failing to start the same way are not started again."""

from __future__ import annotations

from nexrl_service.group_starts import GroupStarts


def _failure(model: str, cause: str) -> RuntimeError:
    return RuntimeError(
        f"worker group 'model-{model}-train-0' is dead: rank 0 failed: {cause} (the ranks' output: /data/workers/{model}.log)"
    )


def test_two_starts_failing_the_same_way_refuse_the_next_naming_the_cause_and_log() -> None:
    starts = GroupStarts()
    starts.failed(_failure("a", "ValueError: no GPU"))
    assert starts.refusal() is None, "one failure may be bad luck"
    starts.failed(_failure("b", "ValueError: no GPU"))
    refusal = starts.refusal()
    assert refusal is not None and "the last 2 failed the same way" in refusal
    assert "rank 0 failed: ValueError: no GPU" in refusal and "/data/workers/b.log" in refusal


def test_a_different_cause_or_a_success_starts_the_count_again() -> None:
    starts = GroupStarts()
    starts.failed(_failure("a", "ValueError: no GPU"))
    starts.failed(_failure("b", "OSError: model not found"))
    assert starts.refusal() is None
    starts.failed(_failure("c", "OSError: model not found"))
    assert starts.refusal() is not None
    starts.succeeded()
    assert starts.refusal() is None
