"""`aggregate`: every mode on a hand-computed case, padding rows and empty batches."""

from __future__ import annotations

import math

import pytest
import torch

from nexrl_grpo.aggregation import aggregate, masked_mean
from nexrl_grpo.config import AggMode

# Row 0 trains three tokens with losses 1, 2, 3 (row sum 6); row 1 trains one token, 4.
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])

EXPECTED = {
    # (1 + 2 + 3 + 4) / 4 tokens
    AggMode.TOKEN_MEAN: 2.5,
    # (6 / 3 + 4 / 1) / 2 rows = (2 + 4) / 2
    AggMode.SEQ_MEAN_TOKEN_MEAN: 3.0,
    # (6 + 4) / 2 rows
    AggMode.SEQ_MEAN_TOKEN_SUM: 5.0,
    # (6 / 3 + 4 / 3) / 2 rows, T = 3
    AggMode.SEQ_MEAN_TOKEN_SUM_NORM: 10.0 / 6.0,
    # 1 + 2 + 3 + 4
    AggMode.TOKEN_SUM: 10.0,
}


@pytest.mark.parametrize("mode", list(AggMode))
def test_hand_computed_value(mode: AggMode) -> None:
    assert aggregate(LOSS, MASK, mode).item() == pytest.approx(EXPECTED[mode])


def test_modes_accept_their_string_names() -> None:
    assert aggregate(LOSS, MASK, "seq-mean-token-sum").item() == pytest.approx(5.0)


def test_seq_mean_token_sum_is_a_sum_not_a_mean() -> None:
    token_sum = aggregate(LOSS, MASK, AggMode.SEQ_MEAN_TOKEN_SUM).item()
    token_mean = aggregate(LOSS, MASK, AggMode.SEQ_MEAN_TOKEN_MEAN).item()
    assert token_sum == pytest.approx(5.0)
    assert token_mean == pytest.approx(3.0)
    assert token_sum != pytest.approx(token_mean)


def test_norm_constant_replaces_column_count() -> None:
    # (6 / 2 + 4 / 2) / 2 rows
    value = aggregate(LOSS, MASK, AggMode.SEQ_MEAN_TOKEN_SUM_NORM, norm_constant=2.0)
    assert value.item() == pytest.approx(2.5)


def test_fractional_weights() -> None:
    loss = torch.tensor([[1.0, 3.0]])
    weights = torch.tensor([[0.5, 1.0]])
    # (0.5 * 1 + 1 * 3) / (0.5 + 1) = 3.5 / 1.5
    assert aggregate(loss, weights, AggMode.TOKEN_MEAN).item() == pytest.approx(3.5 / 1.5)
    # 0.5 * 1 + 1 * 3
    assert aggregate(loss, weights, AggMode.TOKEN_SUM).item() == pytest.approx(3.5)


@pytest.mark.parametrize("mode", list(AggMode))
def test_padding_rows_change_nothing(mode: AggMode) -> None:
    padded_loss = torch.cat([LOSS, torch.tensor([[math.nan, math.inf, 7.0]])])
    padded_mask = torch.cat([MASK, torch.zeros(1, 3)])
    assert aggregate(padded_loss, padded_mask, mode).item() == pytest.approx(EXPECTED[mode])


@pytest.mark.parametrize("mode", list(AggMode))
def test_nothing_trained_gives_zero_with_a_graph(mode: AggMode) -> None:
    loss = torch.tensor([[1.0, math.nan], [2.0, 3.0]], requires_grad=True)
    value = aggregate(loss, torch.zeros(2, 2), mode)
    assert value.item() == 0.0
    value.backward()
    assert loss.grad is not None
    assert torch.equal(loss.grad, torch.zeros(2, 2))


def test_masked_positions_get_no_gradient_even_when_nan() -> None:
    loss = torch.tensor([[1.0, math.nan]], requires_grad=True)
    aggregate(loss, torch.tensor([[1.0, 0.0]]), AggMode.TOKEN_MEAN).backward()
    assert loss.grad is not None
    assert loss.grad.tolist() == [[1.0, 0.0]]


def test_masked_mean() -> None:
    # (1 + 2 + 3 + 4) / 4
    assert masked_mean(LOSS, MASK).item() == pytest.approx(2.5)


def test_unknown_mode_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        aggregate(LOSS, MASK, "sequence-mean")


def test_shape_mismatch_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"same \[B, T\] shape"):
        aggregate(LOSS, MASK[:, :2], AggMode.TOKEN_MEAN)


def test_non_positive_norm_constant_is_rejected() -> None:
    with pytest.raises(ValueError, match="norm_constant"):
        aggregate(LOSS, MASK, AggMode.SEQ_MEAN_TOKEN_SUM_NORM, norm_constant=0.0)
