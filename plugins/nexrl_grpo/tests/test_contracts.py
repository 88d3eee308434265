"""Every estimator and loss this plugin registers passes NexRL's conformance contracts."""

from __future__ import annotations

from typing import Any

import pytest

from nexrl_core.plugins.registry import find_spec, get_advantage_estimator, get_policy_loss
from nexrl_core.testing import AdvantageEstimatorContract, PolicyLossContract
from nexrl_core.testing.aggregation_cases import loss_aggregation_cases

ESTIMATORS = ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus"]
LOSSES: list[tuple[str, dict[str, Any]]] = [
    *loss_aggregation_cases(),
    ("ppo", {"dual_clip_c": 3.0, "clip_high": 0.28, "agg_mode": "seq-mean-token-sum-norm"}),
    ("ppo", {"entropy_coeff": 0.01, "agg_mode": "seq-mean-token-mean"}),
    ("gspo", {"entropy_coeff": 0.01}),
]
"""Every registered loss under every aggregation, and options that change its path."""


DISTILLATION_OPTIONS = [{}, {"kl_discount": 0.9}, {"task_advantage": "grpo", "kl_coef": 0.5}]
"""On-policy distillation alone, discounted, and with the task reward's GRPO advantage."""


class TestEstimatorContracts(AdvantageEstimatorContract):
    @pytest.fixture(params=ESTIMATORS)
    def estimator(self, request: pytest.FixtureRequest) -> Any:
        return get_advantage_estimator(request.param)


class TestDistillationContracts(AdvantageEstimatorContract):
    @pytest.fixture(params=DISTILLATION_OPTIONS, ids=str)
    def estimator(self, request: pytest.FixtureRequest) -> Any:
        config_class = find_spec("advantage_estimators", "on_policy_distillation").config_class
        return get_advantage_estimator("on_policy_distillation", config_class(**request.param))


class TestLossContracts(PolicyLossContract):
    @pytest.fixture(params=LOSSES, ids=lambda case: f"{case[0]}{case[1] or ''}")
    def policy_loss(self, request: pytest.FixtureRequest) -> Any:
        name, options = request.param
        return get_policy_loss(name, find_spec("policy_losses", name).config_class(**options))
