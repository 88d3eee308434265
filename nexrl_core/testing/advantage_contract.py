"""Contract every advantage estimator must meet.

Subclass `AdvantageEstimatorContract` and override the ``estimator`` fixture to return a
built estimator. The checks hold for any sound estimator: shapes, masking, finiteness,
invariance to row order, degenerate groups, and padding rows that change nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from nexrl_core.training.algorithms import ADVANTAGE_INPUTS, AdvantageEstimator, AdvantageInputs, AdvantageOutput, GroupKey


def make_advantage_inputs(
    rewards: Sequence[float],
    group_ids: Sequence[str],
    run_ids: Sequence[int] | None = None,
    response_lengths: Sequence[int] | None = None,
    width: int = 6,
    seed: int = 0,
) -> AdvantageInputs:
    """Build inputs with each reward on the last trained token of its row.

    Rows have a 2-token prompt (mask 0), then ``response_lengths[i]`` trained tokens
    with one untrained "tool" token in the middle when the response is long enough.
    """
    generator = torch.Generator().manual_seed(seed)
    batch = len(rewards)
    lengths = list(response_lengths or [width - 2] * batch)
    loss_mask = torch.zeros(batch, width)
    token_rewards = torch.zeros(batch, width)
    for row, length in enumerate(lengths):
        loss_mask[row, 2 : 2 + length] = 1.0
        if length >= 3:
            loss_mask[row, 3] = 0.0
        token_rewards[row, 2 + length - 1] = rewards[row]
    logprobs = -torch.rand(batch, width, generator=generator, dtype=torch.float32) * 3
    teacher_logprobs = -torch.rand(batch, width, generator=generator, dtype=torch.float32) * 3
    return AdvantageInputs(
        token_rewards=token_rewards,
        loss_mask=loss_mask,
        valid_rows=torch.ones(batch, dtype=torch.bool),
        group_ids=list(group_ids),
        run_ids=list(run_ids if run_ids is not None else range(batch)),
        old_logprobs=logprobs,
        ref_logprobs=logprobs - 0.1,
        teacher_logprobs=teacher_logprobs,
    )


def _select_rows(inputs: AdvantageInputs, order: Sequence[int]) -> AdvantageInputs:
    index = torch.tensor(list(order))

    def pick(values: Sequence[GroupKey] | None) -> list[GroupKey] | None:
        return None if values is None else [values[i] for i in order]

    def pick_tensor(values: torch.Tensor | None) -> torch.Tensor | None:
        return None if values is None else values[index]

    return AdvantageInputs(
        token_rewards=inputs.token_rewards[index],
        loss_mask=inputs.loss_mask[index],
        valid_rows=inputs.valid_rows[index],
        group_ids=pick(inputs.group_ids),
        run_ids=pick(inputs.run_ids),
        old_logprobs=pick_tensor(inputs.old_logprobs),
        ref_logprobs=pick_tensor(inputs.ref_logprobs),
        teacher_logprobs=pick_tensor(inputs.teacher_logprobs),
    )


def _append_padding_rows(inputs: AdvantageInputs, count: int) -> AdvantageInputs:
    """Add rows the way ``Batch.pad_to_world_size`` does, but with rewards that would move
    statistics if an estimator wrongly counted them."""
    width = inputs.loss_mask.shape[1]
    garbage = torch.full((count, width), 100.0)
    return AdvantageInputs(
        token_rewards=torch.cat([inputs.token_rewards, garbage]),
        loss_mask=torch.cat([inputs.loss_mask, torch.zeros(count, width)]),
        valid_rows=torch.cat([inputs.valid_rows, torch.zeros(count, dtype=torch.bool)]),
        group_ids=list(inputs.group_ids or []) + [inputs.group_ids[0] if inputs.group_ids else "g"] * count,
        run_ids=list(inputs.run_ids or []) + [f"pad{i}" for i in range(count)],
        old_logprobs=None if inputs.old_logprobs is None else torch.cat([inputs.old_logprobs, garbage * 0]),
        ref_logprobs=None if inputs.ref_logprobs is None else torch.cat([inputs.ref_logprobs, garbage * 0]),
        teacher_logprobs=None if inputs.teacher_logprobs is None else torch.cat([inputs.teacher_logprobs, garbage]),
    )


MIXED_REWARDS = [1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 1.0, 0.25]
MIXED_GROUPS = ["a", "a", "a", "a", "b", "b", "b", "b"]


class AdvantageEstimatorContract:
    """Checks any advantage estimator; override the ``estimator`` fixture."""

    @pytest.fixture
    def estimator(self) -> AdvantageEstimator:
        raise NotImplementedError("override the 'estimator' fixture to return a built estimator")

    def run(self, estimator: AdvantageEstimator, inputs: AdvantageInputs) -> AdvantageOutput:
        output = estimator(inputs)
        assert isinstance(output, AdvantageOutput), f"estimator returned {type(output).__name__}, not AdvantageOutput"
        return output

    def test_declares_its_inputs(self, estimator: AdvantageEstimator) -> None:
        assert isinstance(estimator.requires, frozenset)
        assert estimator.requires <= ADVANTAGE_INPUTS, f"unknown inputs {set(estimator.requires) - ADVANTAGE_INPUTS}"
        assert isinstance(estimator.group_relative, bool)

    def test_shapes_and_dtype(self, estimator: AdvantageEstimator) -> None:
        inputs = make_advantage_inputs(MIXED_REWARDS, MIXED_GROUPS)
        output = self.run(estimator, inputs)
        assert output.advantages.shape == inputs.loss_mask.shape
        assert output.returns.shape == inputs.loss_mask.shape
        assert output.advantages.is_floating_point()
        assert all(isinstance(value, float) for value in output.metrics.values())

    def test_untrained_tokens_get_zero(self, estimator: AdvantageEstimator) -> None:
        inputs = make_advantage_inputs(MIXED_REWARDS, MIXED_GROUPS, response_lengths=[4, 3, 2, 1, 4, 3, 2, 1])
        output = self.run(estimator, inputs)
        assert torch.all(output.advantages[inputs.loss_mask == 0] == 0)

    def test_outputs_are_finite(self, estimator: AdvantageEstimator) -> None:
        generator = torch.Generator().manual_seed(1)
        rewards = (torch.randn(16, generator=generator) * 5).tolist()
        inputs = make_advantage_inputs(rewards, [f"g{i // 4}" for i in range(16)])
        output = self.run(estimator, inputs)
        assert torch.isfinite(output.advantages).all()
        assert torch.isfinite(output.returns).all()

    def test_row_order_does_not_matter(self, estimator: AdvantageEstimator) -> None:
        inputs = make_advantage_inputs(MIXED_REWARDS, MIXED_GROUPS)
        order = [5, 2, 7, 0, 3, 6, 1, 4]
        reference = self.run(estimator, inputs)
        permuted = self.run(estimator, _select_rows(inputs, order))
        torch.testing.assert_close(permuted.advantages, reference.advantages[torch.tensor(order)])

    def test_group_with_equal_rewards(self, estimator: AdvantageEstimator) -> None:
        inputs = make_advantage_inputs([0.7] * 4 + [1.0, 0.0, 1.0, 0.0], MIXED_GROUPS)
        output = self.run(estimator, inputs)
        assert torch.isfinite(output.advantages).all()
        if estimator.group_relative:
            assert torch.all(output.advantages[:4] == 0), "a group whose rewards are all equal carries no signal"

    def test_single_member_group(self, estimator: AdvantageEstimator) -> None:
        inputs = make_advantage_inputs([1.0, 0.0, 1.0], ["solo", "pair", "pair"])
        output = self.run(estimator, inputs)
        assert torch.isfinite(output.advantages).all()
        if estimator.group_relative:
            assert torch.all(output.advantages[0] == 0), "a group of one has no baseline to compare with"

    def test_padding_rows_change_nothing(self, estimator: AdvantageEstimator) -> None:
        inputs = make_advantage_inputs(MIXED_REWARDS, MIXED_GROUPS)
        reference = self.run(estimator, inputs)
        padded = self.run(estimator, _append_padding_rows(inputs, 3))
        real = len(MIXED_REWARDS)
        torch.testing.assert_close(padded.advantages[:real], reference.advantages)
        assert torch.all(padded.advantages[real:] == 0)

    def test_rejects_non_finite_rewards(self, estimator: AdvantageEstimator) -> None:
        inputs = make_advantage_inputs([1.0, float("nan"), 0.0, 1.0], ["a", "a", "b", "b"])
        with pytest.raises(ValueError):
            estimator(inputs)
