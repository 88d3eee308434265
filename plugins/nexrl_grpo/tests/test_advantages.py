"""Advantage estimators on hand-computed cases, edge cases and input checks."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from nexrl_core.training.algorithms import AdvantageInputs, GroupKey
from nexrl_grpo.advantages import DrGrpoEstimator, GrpoEstimator, ReinforcePlusPlusEstimator, RlooEstimator
from nexrl_grpo.config import DrGrpoConfig, GrpoConfig, ReinforcePlusPlusConfig, RlooConfig

T = 3


def outcome_batch(
    scores: Sequence[float],
    group_ids: Sequence[GroupKey],
    run_ids: Sequence[GroupKey] | None = None,
    valid: Sequence[bool] | None = None,
) -> AdvantageInputs:
    """Rows of T trained tokens whose outcome reward sits on the last token."""
    rewards = torch.zeros(len(scores), T)
    rewards[:, -1] = torch.tensor(scores)
    return AdvantageInputs(
        token_rewards=rewards,
        loss_mask=torch.ones(len(scores), T),
        valid_rows=torch.tensor([True] * len(scores) if valid is None else list(valid)),
        group_ids=list(group_ids),
        run_ids=list(range(len(scores))) if run_ids is None else list(run_ids),
    )


def row_values(advantages: torch.Tensor) -> list[float]:
    """The one value each row carries, after checking it is the same on every token."""
    assert torch.equal(advantages, advantages[:, :1].expand_as(advantages))
    return advantages[:, 0].tolist()


def assert_values(actual: torch.Tensor, expected: list[list[float]], atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def grpo(**options: object):
    return GrpoEstimator(GrpoConfig(**options))


GROUP_RELATIVE = {
    "grpo": lambda: GrpoEstimator(GrpoConfig()),
    "dr_grpo": lambda: DrGrpoEstimator(DrGrpoConfig()),
    "rloo": lambda: RlooEstimator(RlooConfig()),
}
ALL = {**GROUP_RELATIVE, "reinforce_plus_plus": lambda: ReinforcePlusPlusEstimator(ReinforcePlusPlusConfig())}

# Group "a": scores 1, 0, 0; group "b": scores 2, 4; every row its own run.
TWO_GROUPS = outcome_batch([1.0, 0.0, 0.0, 2.0, 4.0], ["a", "a", "a", "b", "b"])

# Group "g": run "r1" has three trajectories scoring 1 (run mean 1), run "r2" one scoring 0.
# Run means 1 and 0; a plain row mean would be 0.75 instead of the two-stage 0.5.
MULTI_TRAJECTORY = outcome_batch([1.0, 1.0, 1.0, 0.0], ["g"] * 4, ["r1", "r1", "r1", "r2"])


# --- hand-computed values ----------------------------------------------------------------------


def test_grpo_two_groups() -> None:
    out = grpo()(TWO_GROUPS)
    # a: mean 1/3; deviations 2/3, -1/3, -1/3; unbiased var (4/9 + 1/9 + 1/9) / 2 = 1/3; std 0.5773503
    #    A = (2/3) / 0.5773503 = 1.1547005, (-1/3) / 0.5773503 = -0.5773503
    # b: mean 3; unbiased var (1 + 1) / 1 = 2; std 1.4142136; A = -1 / 1.4142136, +1 / 1.4142136
    expected = [1.1547005, -0.5773503, -0.5773503, -0.7071068, 0.7071068]
    assert row_values(out.advantages) == pytest.approx(expected, abs=1e-5)
    assert torch.equal(out.returns, out.advantages)
    assert out.metrics["groups/count"] == 2.0
    assert out.metrics["groups/degenerate"] == 0.0
    # (1 + 0 + 0 + 2 + 4) / 5
    assert out.metrics["score/mean"] == pytest.approx(1.4)


def test_grpo_without_std_normalisation_is_mean_centred() -> None:
    out = grpo(norm_by_std=False)(TWO_GROUPS)
    # a: 1 - 1/3, 0 - 1/3, 0 - 1/3; b: 2 - 3, 4 - 3
    assert row_values(out.advantages) == pytest.approx([2 / 3, -1 / 3, -1 / 3, -1.0, 1.0])


def test_grpo_eps_is_added_to_the_std() -> None:
    out = grpo(eps=1.0)(TWO_GROUPS)
    # the stds of test_grpo_two_groups plus 1: a 1.5773503, b 2.4142136
    expected = [(2 / 3) / 1.5773503, (-1 / 3) / 1.5773503, (-1 / 3) / 1.5773503, -1 / 2.4142136, 1 / 2.4142136]
    assert row_values(out.advantages) == pytest.approx(expected, abs=1e-5)


def test_grpo_averages_a_multi_trajectory_run_first() -> None:
    out = grpo()(MULTI_TRAJECTORY)
    # run means 1, 0: baseline 0.5; unbiased std sqrt((0.25 + 0.25) / 1) = 0.7071068
    # r1 rows: 0.5 / 0.7071068 = 0.7071068; r2 row: -0.7071068
    assert row_values(out.advantages) == pytest.approx([0.7071068, 0.7071068, 0.7071068, -0.7071068], abs=1e-5)


def test_dr_grpo() -> None:
    out = DrGrpoEstimator(DrGrpoConfig())(TWO_GROUPS)
    # a: mean 1/3 -> 2/3, -1/3, -1/3; b: mean 3 -> -1, 1
    assert row_values(out.advantages) == pytest.approx([2 / 3, -1 / 3, -1 / 3, -1.0, 1.0])
    multi = DrGrpoEstimator(DrGrpoConfig())(MULTI_TRAJECTORY)
    # baseline = mean of run means (1 + 0) / 2 = 0.5
    assert row_values(multi.advantages) == pytest.approx([0.5, 0.5, 0.5, -0.5])


def test_rloo() -> None:
    out = RlooEstimator(RlooConfig())(TWO_GROUPS)
    # a: row 0 baseline (0 + 0) / 2 = 0 -> 1; rows 1, 2 baseline (1 + 0) / 2 = 0.5 -> -0.5
    # b: row 3 baseline 4 -> -2; row 4 baseline 2 -> 2
    assert row_values(out.advantages) == pytest.approx([1.0, -0.5, -0.5, -2.0, 2.0])


def test_rloo_leaves_out_the_whole_run() -> None:
    batch = outcome_batch([1.0, 0.0, 0.0, 1.0], ["g"] * 4, ["r1", "r1", "r2", "r3"])
    out = RlooEstimator(RlooConfig())(batch)
    # run means: r1 0.5, r2 0, r3 1
    # r1 rows: baseline (0 + 1) / 2 = 0.5 -> 1 - 0.5 = 0.5, 0 - 0.5 = -0.5
    # r2: baseline (0.5 + 1) / 2 = 0.75 -> -0.75; r3: baseline (0.5 + 0) / 2 = 0.25 -> 0.75
    assert row_values(out.advantages) == pytest.approx([0.5, -0.5, -0.75, 0.75])
    multi = RlooEstimator(RlooConfig())(MULTI_TRAJECTORY)
    # r1 baseline = r2's mean 0 -> 1; r2 baseline = r1's mean 1 -> -1
    assert row_values(multi.advantages) == pytest.approx([1.0, 1.0, 1.0, -1.0])


# Row 0 rewards [0, 0, 1]; row 1 rewards [0, 0.5, -1]; all six tokens trained.
RPP_BATCH = AdvantageInputs(
    token_rewards=torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, -1.0]]),
    loss_mask=torch.ones(2, 3),
    valid_rows=torch.tensor([True, True]),
)


def test_reinforce_plus_plus_gamma_one() -> None:
    out = ReinforcePlusPlusEstimator(ReinforcePlusPlusConfig(gamma=1.0))(RPP_BATCH)
    # returns-to-go: row 0 [1, 1, 1]; row 1: t2 = -1, t1 = 0.5 - 1 = -0.5, t0 = -0.5
    assert_values(out.returns, [[1.0, 1.0, 1.0], [-0.5, -0.5, -1.0]])
    # mean (3 - 2) / 6 = 1/6; deviations 5/6 (x3), -4/6 (x2), -7/6;
    # population var (3 * 25 + 2 * 16 + 49) / 36 / 6 = 13/18; std sqrt(13/18) = 0.8498366
    # whitened = (5/6) / 0.8498366 = 0.9805807, (-4/6) / . = -0.7844645, (-7/6) / . = -1.3728129
    assert_values(out.advantages, [[0.9805807] * 3, [-0.7844645, -0.7844645, -1.3728129]])
    assert out.metrics["returns/mean"] == pytest.approx(1 / 6)


def test_reinforce_plus_plus_gamma_half() -> None:
    out = ReinforcePlusPlusEstimator(ReinforcePlusPlusConfig(gamma=0.5))(RPP_BATCH)
    # row 0: t2 = 1, t1 = 0 + 0.5 * 1 = 0.5, t0 = 0 + 0.5 * 0.5 = 0.25
    # row 1: t2 = -1, t1 = 0.5 + 0.5 * -1 = 0, t0 = 0 + 0.5 * 0 = 0
    assert_values(out.returns, [[0.25, 0.5, 1.0], [0.0, 0.0, -1.0]])
    # mean 0.75 / 6 = 0.125; deviations 0.125, 0.375, 0.875, -0.125, -0.125, -1.125
    # var (0.015625 * 3 + 0.140625 + 0.765625 + 1.265625) / 6 = 2.21875 / 6; std 0.6081050
    # whitened: 0.125 / 0.6081050 = 0.2055566, 0.375 / . = 0.6166699, 0.875 / . = 1.4388965,
    #           -0.2055566, -0.2055566, -1.125 / . = -1.8500096
    assert_values(out.advantages, [[0.2055566, 0.6166699, 1.4388965], [-0.2055566, -0.2055566, -1.8500096]])


def test_reinforce_plus_plus_eps_is_added_to_the_std() -> None:
    out = ReinforcePlusPlusEstimator(ReinforcePlusPlusConfig(gamma=1.0, eps=1.0))(RPP_BATCH)
    # the deviations and std of test_reinforce_plus_plus_gamma_one, divided by std + 1 = 1.8498366
    assert_values(out.advantages, [[(5 / 6) / 1.8498366] * 3, [(-4 / 6) / 1.8498366] * 2 + [(-7 / 6) / 1.8498366]])


def test_reinforce_plus_plus_discounts_trained_tokens_only() -> None:
    batch = AdvantageInputs(
        token_rewards=torch.tensor([[0.0, 9.0, 1.0], [0.0, 0.0, 0.0]]),
        loss_mask=torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]]),
        valid_rows=torch.tensor([True, True]),
    )
    out = ReinforcePlusPlusEstimator(ReinforcePlusPlusConfig(gamma=0.5))(batch)
    # The untrained middle token neither adds its 9 nor counts as a discount step:
    # row 0 returns t2 = 1, t0 = 0 + 0.5 * 1 = 0.5; the middle one is 0 (untrained).
    assert out.returns.tolist() == [[0.5, 0.0, 1.0], [0.0, 0.0, 0.0]]
    assert out.advantages[0, 1].item() == 0.0


# --- degenerate groups ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(GROUP_RELATIVE))
def test_equal_rewards_give_exactly_zero(name: str) -> None:
    batch = outcome_batch([0.7, 0.7, 0.7, 0.3, 0.3], ["a", "a", "a", "b", "b"])
    out = GROUP_RELATIVE[name]()(batch)
    assert torch.equal(out.advantages, torch.zeros(5, T))
    assert out.metrics["groups/degenerate"] == 2.0


@pytest.mark.parametrize("name", list(GROUP_RELATIVE))
def test_equal_rewards_over_runs_of_different_sizes_give_exactly_zero(name: str) -> None:
    # Run means 0.1 * 3 / 3 and 0.1 differ by one ulp; the group is still degenerate.
    batch = outcome_batch([0.1, 0.1, 0.1, 0.1], ["g"] * 4, ["a", "a", "a", "b"])
    out = GROUP_RELATIVE[name]()(batch)
    assert torch.equal(out.advantages, torch.zeros(4, T))


@pytest.mark.parametrize("name", list(GROUP_RELATIVE))
def test_single_member_group_gives_zero(name: str) -> None:
    batch = outcome_batch([1.0, 0.0, 5.0], ["a", "a", "lonely"])
    out = GROUP_RELATIVE[name]()(batch)
    assert row_values(out.advantages)[2] == 0.0
    assert not math.isnan(out.advantages.sum().item())
    assert out.metrics["groups/degenerate"] == 1.0


@pytest.mark.parametrize("name", list(GROUP_RELATIVE))
def test_single_run_with_several_trajectories_gives_zero(name: str) -> None:
    batch = outcome_batch([1.0, 0.0, 0.5], ["g"] * 3, ["run"] * 3)
    out = GROUP_RELATIVE[name]()(batch)
    assert torch.equal(out.advantages, torch.zeros(3, T))


def test_equal_run_ids_in_different_groups_are_different_runs() -> None:
    batch = outcome_batch([1.0, 0.0, 1.0, 0.0], ["a", "a", "b", "b"], [0, 1, 0, 1])
    out = DrGrpoEstimator(DrGrpoConfig())(batch)
    assert row_values(out.advantages) == pytest.approx([0.5, -0.5, 0.5, -0.5])


def test_tensor_group_ids_group_by_value() -> None:
    batch = outcome_batch([1.0, 0.0, 2.0, 4.0], [0, 0, 1, 1])
    batch = AdvantageInputs(
        token_rewards=batch.token_rewards,
        loss_mask=batch.loss_mask,
        valid_rows=batch.valid_rows,
        group_ids=torch.tensor([0, 0, 1, 1]),
        run_ids=torch.arange(4),
    )
    out = DrGrpoEstimator(DrGrpoConfig())(batch)
    assert row_values(out.advantages) == pytest.approx([0.5, -0.5, -1.0, 1.0])


# --- padding and masks -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(ALL))
def test_invalid_rows_change_nothing_and_get_zero(name: str) -> None:
    estimator = ALL[name]()
    plain = estimator(TWO_GROUPS)
    rewards = torch.cat([TWO_GROUPS.token_rewards, torch.tensor([[math.nan, math.inf, 100.0]] * 2)])
    padded = AdvantageInputs(
        token_rewards=rewards,
        loss_mask=torch.ones(7, T),
        valid_rows=torch.tensor([True] * 5 + [False] * 2),
        group_ids=["a", "a", "a", "b", "b", "a", "c"],
        run_ids=[0, 1, 2, 3, 4, 9, 9],
    )
    out = estimator(padded)
    assert torch.equal(out.advantages[:5], plain.advantages)
    assert torch.equal(out.returns[:5], plain.returns)
    assert torch.equal(out.advantages[5:], torch.zeros(2, T))
    assert torch.equal(out.returns[5:], torch.zeros(2, T))
    assert out.metrics == plain.metrics


@pytest.mark.parametrize("name", list(ALL))
def test_rows_without_trained_tokens_change_nothing_and_get_zero(name: str) -> None:
    estimator = ALL[name]()
    plain = estimator(TWO_GROUPS)
    padded = AdvantageInputs(
        token_rewards=torch.cat([TWO_GROUPS.token_rewards, torch.zeros(1, T)]),
        loss_mask=torch.cat([TWO_GROUPS.loss_mask, torch.zeros(1, T)]),
        valid_rows=torch.ones(6, dtype=torch.bool),
        group_ids=["a", "a", "a", "b", "b", "a"],
        run_ids=[0, 1, 2, 3, 4, 5],
    )
    out = estimator(padded)
    assert torch.equal(out.advantages[:5], plain.advantages)
    assert torch.equal(out.advantages[5], torch.zeros(T))


@pytest.mark.parametrize("name", list(ALL))
def test_untrained_tokens_get_zero(name: str) -> None:
    mask = torch.tensor([[0.0, 1.0, 1.0]] * 5)
    batch = AdvantageInputs(
        token_rewards=TWO_GROUPS.token_rewards,
        loss_mask=mask,
        valid_rows=TWO_GROUPS.valid_rows,
        group_ids=TWO_GROUPS.group_ids,
        run_ids=TWO_GROUPS.run_ids,
    )
    out = ALL[name]()(batch)
    assert torch.equal(out.advantages[:, 0], torch.zeros(5))
    assert torch.equal(out.returns[:, 0], torch.zeros(5))


@pytest.mark.parametrize("name", list(ALL))
def test_no_rows_at_all_to_count(name: str) -> None:
    batch = outcome_batch([1.0, 0.0], ["a", "a"], valid=[False, False])
    out = ALL[name]()(batch)
    assert torch.equal(out.advantages, torch.zeros(2, T))
    assert all(math.isfinite(v) for v in out.metrics.values())


# --- order and determinism -------------------------------------------------------------------------------


def random_batch(seed: int) -> AdvantageInputs:
    generator = torch.Generator().manual_seed(seed)
    batch, width = 48, 6
    rewards = torch.randn(batch, width, generator=generator)
    mask = (torch.rand(batch, width, generator=generator) > 0.3).float()
    valid = torch.rand(batch, generator=generator) > 0.1
    groups = torch.randint(0, 8, (batch,), generator=generator).tolist()
    runs = torch.randint(0, 4, (batch,), generator=generator).tolist()
    return AdvantageInputs(
        token_rewards=rewards,
        loss_mask=mask,
        valid_rows=valid,
        group_ids=[f"prompt-{g}" for g in groups],
        run_ids=runs,
    )


@pytest.mark.parametrize("name", list(ALL))
def test_permuting_rows_permutes_outputs_bit_for_bit(name: str) -> None:
    torch.manual_seed(0)
    batch = random_batch(seed=0)
    permutation = torch.randperm(batch.token_rewards.shape[0])
    shuffled = AdvantageInputs(
        token_rewards=batch.token_rewards[permutation],
        loss_mask=batch.loss_mask[permutation],
        valid_rows=batch.valid_rows[permutation],
        group_ids=[batch.group_ids[i] for i in permutation.tolist()],
        run_ids=[batch.run_ids[i] for i in permutation.tolist()],
    )
    estimator = ALL[name]()
    out, out_shuffled = estimator(batch), estimator(shuffled)
    assert torch.equal(out.advantages[permutation], out_shuffled.advantages)
    assert torch.equal(out.returns[permutation], out_shuffled.returns)
    assert out.metrics == out_shuffled.metrics
    again = estimator(batch)
    assert torch.equal(out.advantages, again.advantages)


@pytest.mark.parametrize("name", list(ALL))
def test_output_dtype_follows_the_rewards(name: str) -> None:
    batch = random_batch(seed=1)
    doubled = AdvantageInputs(
        token_rewards=batch.token_rewards.double(),
        loss_mask=batch.loss_mask,
        valid_rows=batch.valid_rows,
        group_ids=batch.group_ids,
        run_ids=batch.run_ids,
    )
    assert ALL[name]()(batch).advantages.dtype == torch.float32
    assert ALL[name]()(doubled).advantages.dtype == torch.float64


# --- input checks ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(ALL))
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_rewards_are_rejected_with_their_rows(name: str, bad: float) -> None:
    rewards = TWO_GROUPS.token_rewards.clone()
    rewards[1, 0] = bad
    rewards[3, 2] = bad
    batch = AdvantageInputs(
        token_rewards=rewards,
        loss_mask=TWO_GROUPS.loss_mask,
        valid_rows=TWO_GROUPS.valid_rows,
        group_ids=TWO_GROUPS.group_ids,
        run_ids=TWO_GROUPS.run_ids,
    )
    with pytest.raises(ValueError, match=rf"{name}.*token_rewards.*\[1, 3\]"):
        ALL[name]()(batch)


@pytest.mark.parametrize("name", list(GROUP_RELATIVE))
def test_missing_group_ids_are_named(name: str) -> None:
    batch = AdvantageInputs(token_rewards=torch.zeros(2, T), loss_mask=torch.ones(2, T), valid_rows=torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="group_ids, run_ids"):
        GROUP_RELATIVE[name]()(batch)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"loss_mask": torch.ones(5, T + 1)}, "loss_mask must have token_rewards' shape"),
        ({"valid_rows": torch.ones(4, dtype=torch.bool)}, r"valid_rows must be \[B\] = \[5\]"),
        ({"group_ids": ["a"] * 4}, "group_ids has 4 entries for a batch of 5 rows"),
        ({"run_ids": [0] * 6}, "run_ids has 6 entries for a batch of 5 rows"),
        ({"token_rewards": torch.zeros(5), "loss_mask": torch.ones(5)}, r"token_rewards must be \[B, T\]"),
    ],
)
def test_shape_errors(change: dict[str, object], message: str) -> None:
    fields = {
        "token_rewards": TWO_GROUPS.token_rewards,
        "loss_mask": TWO_GROUPS.loss_mask,
        "valid_rows": TWO_GROUPS.valid_rows,
        "group_ids": TWO_GROUPS.group_ids,
        "run_ids": TWO_GROUPS.run_ids,
        **change,
    }
    with pytest.raises(ValueError, match=message):
        grpo()(AdvantageInputs(**fields))


def test_estimators_declare_the_protocol_attributes() -> None:
    for name, make in ALL.items():
        estimator = make()
        assert estimator.group_relative is (name in GROUP_RELATIVE)
        assert estimator.requires == (frozenset({"group_ids", "run_ids"}) if name in GROUP_RELATIVE else frozenset())
