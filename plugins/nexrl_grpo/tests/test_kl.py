"""KL penalties and controllers on hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from nexrl_core.config.schema import KLController, KLSettings
from nexrl_grpo.kl import AdaptiveKLController, FixedKLController, build_kl_controller, kl_penalty

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
