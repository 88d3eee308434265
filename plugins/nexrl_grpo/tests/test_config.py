"""Config classes: defaults, string values from YAML, and clear validation errors."""

from __future__ import annotations

import math

import attrs
import cattrs
import pytest

from nexrl_grpo.config import (
    AggMode,
    CispoLossConfig,
    CrossEntropyLossConfig,
    GrpoConfig,
    GspoLossConfig,
    ImportanceSamplingLossConfig,
    PPOLossConfig,
    ReinforcePlusPlusConfig,
)


def test_defaults() -> None:
    assert GrpoConfig() == GrpoConfig(norm_by_std=True, eps=1e-6)
    assert ReinforcePlusPlusConfig() == ReinforcePlusPlusConfig(gamma=1.0, eps=1e-8)
    ppo = PPOLossConfig()
    assert (ppo.clip_low, ppo.clip_high, ppo.dual_clip_c) == (0.2, 0.2, None)
    assert (ppo.agg_mode, ppo.norm_constant, ppo.entropy_coeff) == (AggMode.TOKEN_MEAN, None, 0.0)
    gspo = GspoLossConfig()
    assert (gspo.clip_low, gspo.clip_high, gspo.agg_mode) == (3e-4, 4e-4, AggMode.SEQ_MEAN_TOKEN_MEAN)


def test_enum_fields_accept_their_string_values() -> None:
    assert PPOLossConfig(agg_mode="token-sum").agg_mode is AggMode.TOKEN_SUM


def test_cattrs_structures_yaml_values() -> None:
    raw = {"clip_high": 0.28, "dual_clip_c": 3, "agg_mode": "seq-mean-token-sum-norm", "norm_constant": 4096}
    config = cattrs.structure(raw, PPOLossConfig)
    assert config == PPOLossConfig(clip_high=0.28, dual_clip_c=3.0, agg_mode=AggMode.SEQ_MEAN_TOKEN_SUM_NORM, norm_constant=4096.0)


def test_configs_are_frozen() -> None:
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        GrpoConfig().eps = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: GrpoConfig(eps=0.0), r"GrpoConfig\.eps must be a finite number > 0, got 0\.0"),
        (lambda: GrpoConfig(eps=None), r"GrpoConfig\.eps must be a finite number > 0, got None"),
        (lambda: GrpoConfig(norm_by_std="false"), r"GrpoConfig\.norm_by_std must be true or false"),
        (lambda: ReinforcePlusPlusConfig(gamma=1.5), r"ReinforcePlusPlusConfig\.gamma must be in \[0, 1\]"),
        (lambda: PPOLossConfig(clip_low=0.0), r"PPOLossConfig\.clip_low must be in \(0, 1\]"),
        (lambda: PPOLossConfig(clip_low=1.5), r"PPOLossConfig\.clip_low must be in \(0, 1\]"),
        (lambda: PPOLossConfig(clip_high=-0.1), r"PPOLossConfig\.clip_high must be a finite number > 0"),
        (lambda: PPOLossConfig(dual_clip_c=1.0), r"PPOLossConfig\.dual_clip_c must be > 1"),
        (lambda: PPOLossConfig(entropy_coeff=-1.0), r"PPOLossConfig\.entropy_coeff must be a finite number >= 0"),
        (lambda: PPOLossConfig(entropy_coeff=math.nan), r"entropy_coeff must be a finite number >= 0"),
        (lambda: CrossEntropyLossConfig(norm_constant=0), r"CrossEntropyLossConfig\.norm_constant must be"),
        (lambda: CispoLossConfig(clip_high=0), r"CispoLossConfig\.clip_high must be"),
        (lambda: GrpoConfig(norm_by_std=False, eps=0.1), r"GrpoConfig\.eps is read only with norm_by_std true"),
        (lambda: PPOLossConfig(norm_constant=4.0), r"PPOLossConfig\.norm_constant is read only by agg_mode seq-mean-token-sum-norm"),
        (lambda: ImportanceSamplingLossConfig(agg_mode="mean"), r"'mean' is not a valid AggMode; choose one of"),
    ],
)
def test_bad_values_are_rejected_clearly(build, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_agg_mode_values() -> None:
    assert [mode.value for mode in AggMode] == [
        "token-mean",
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
        "token-sum",
    ]
