"""KL penalties and controllers on hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from nexrl_core.config.schema import KLController, KLSettings
from nexrl_grpo.kl import AdaptiveKLController, FixedKLController, KLInReward, build_kl_controller, kl_penalty

# logp - ref = [0.5, -1.0]
LOGP = torch.tensor([-1.0, -2.0], dtype=torch.float64)
REF = torch.tensor([-1.5, -1.0], dtype=torch.float64)


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("kl", [0.5, -1.0]),
        ("abs", [0.5, 1.0]),
        # 0.5 * 0.5^2, 0.5 * 1^2
        ("mse", [0.125, 0.5]),
        # k = ref - logp = [-0.5, 1.0]; e^-0.5 + 0.5 - 1 = 0.1065307, e^1 - 1 - 1 = 0.7182818
        ("low_var_kl", [0.10653066, 0.71828183]),
    ],
)
def test_penalty_values(kind: str, expected: list[float]) -> None:
    assert kl_penalty(LOGP, REF, kind).tolist() == pytest.approx(expected, abs=1e-7)


def test_low_var_kl_is_clamped_and_finite_far_from_the_reference() -> None:
    # k = -100 -> clamped to -20: e^-20 + 20 - 1 = 19.0 -> clamped to 10.
    # k = +100 -> clamped to 20: e^20 - 21 (about 4.9e8) -> clamped to 10.
    logp = torch.tensor([0.0, -100.0])
    ref = torch.tensor([-100.0, 0.0])
    assert kl_penalty(logp, ref, "low_var_kl").tolist() == [10.0, 10.0]


def test_low_var_kl_is_zero_on_the_reference() -> None:
    assert kl_penalty(LOGP, LOGP, "low_var_kl").tolist() == [0.0, 0.0]


def test_unknown_kind_lists_valid_kinds() -> None:
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(LOGP, REF, "k4")


def test_shape_mismatch_is_rejected() -> None:
    with pytest.raises(ValueError, match="same shape"):
        kl_penalty(LOGP, REF[:1], "kl")


def test_fixed_controller_never_moves() -> None:
    controller = FixedKLController(0.3)
    controller.update(current_kl=5.0, n_steps=100)
    assert controller.value == 0.3


def test_adaptive_controller_steps() -> None:
    controller = AdaptiveKLController(init_coef=0.1, target_kl=1.0, horizon=10)
    # error = 1.5 - 1 = 0.5 -> clipped to 0.2; 0.1 * (1 + 0.2 * 1 / 10) = 0.102
    controller.update(current_kl=1.5, n_steps=1)
    assert controller.value == pytest.approx(0.102)
    # error = -0.1; 0.102 * (1 - 0.1 * 2 / 10) = 0.102 * 0.98 = 0.09996
    controller.update(current_kl=0.9, n_steps=2)
    assert controller.value == pytest.approx(0.09996)
    # error = -1 -> clipped to -0.2; 0.09996 * (1 - 0.2 * 5 / 10) = 0.089964
    controller.update(current_kl=0.0, n_steps=5)
    assert controller.value == pytest.approx(0.089964)
    # on target: unchanged
    controller.update(current_kl=1.0, n_steps=3)
    assert controller.value == pytest.approx(0.089964)


def test_controllers_reject_bad_arguments() -> None:
    with pytest.raises(ValueError, match="coef must be >= 0"):
        FixedKLController(-1.0)
    with pytest.raises(ValueError, match="target_kl must be > 0"):
        AdaptiveKLController(init_coef=0.1, target_kl=0.0, horizon=10)
    with pytest.raises(ValueError, match="horizon must be > 0"):
        AdaptiveKLController(init_coef=0.1, target_kl=1.0, horizon=0)
    with pytest.raises(ValueError, match="init_coef must be >= 0"):
        AdaptiveKLController(init_coef=math.nan, target_kl=1.0, horizon=10)


def test_build_kl_controller() -> None:
    fixed = build_kl_controller(KLSettings(coef=0.05))
    assert isinstance(fixed, FixedKLController)
    assert fixed.value == 0.05
    adaptive = build_kl_controller(KLSettings(controller=KLController.ADAPTIVE, coef=0.2, target=0.5, horizon=100))
    assert isinstance(adaptive, AdaptiveKLController)
    assert (adaptive.value, adaptive.target_kl, adaptive.horizon) == (0.2, 0.5, 100)


def _log_ratio_formula(lp: float, ref: float, kind: str) -> float:
    """Each penalty written out from its definition, one token at a time."""
    if kind == "kl":
        return lp - ref
    if kind == "abs":
        return abs(lp - ref)
    if kind == "mse":
        return 0.5 * (lp - ref) ** 2
    return math.exp(ref - lp) - (ref - lp) - 1.0


@pytest.mark.parametrize("kind", ["kl", "abs", "mse", "low_var_kl"])
def test_each_penalty_shapes_the_reward_by_its_formula(kind: str) -> None:
    """The reward a step trains on, not only the ``kl/mean`` metric: each trained token's
    reward drops by coef x that token's penalty; untrained tokens keep theirs."""
    logprobs = [[-0.3, -1.2, -2.0, -0.7]]
    reference = [[-0.9, -0.4, -2.5, -0.1]]
    mask = [[0.0, 1.0, 1.0, 1.0]]
    rewards = [[0.0, 0.0, 0.0, 1.0]]
    shaped, metrics = KLInReward(KLSettings(coef=0.3, penalty=kind)).apply(
        torch.tensor(rewards), torch.tensor(logprobs), torch.tensor(reference), torch.tensor(mask), rows=1
    )
    expected = [
        reward - 0.3 * weight * _log_ratio_formula(lp, ref, kind)
        for reward, weight, lp, ref in zip(rewards[0], mask[0], logprobs[0], reference[0])
    ]
    assert shaped[0].tolist() == pytest.approx(expected, abs=1e-6)
    trained = [_log_ratio_formula(lp, ref, kind) for weight, lp, ref in zip(mask[0], logprobs[0], reference[0]) if weight]
    assert metrics["kl/mean"] == pytest.approx(sum(trained) / len(trained), abs=1e-6)
