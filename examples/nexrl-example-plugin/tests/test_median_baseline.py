"""The example plugin passes NexRL's conformance contract and shows up in `nexrl plugins`."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from nexrl_core.cli import cli
from nexrl_core.plugins.registry import get_advantage_estimator
from nexrl_core.testing import AdvantageEstimatorContract
from nexrl_core.testing.advantage_contract import make_advantage_inputs
from nexrl_example_plugin.plugin import MedianBaselineConfig


def test_plugin_is_listed() -> None:
    result = CliRunner().invoke(cli, ["plugins", "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["name"]: row for row in json.loads(result.output)}
    assert rows["example"]["distribution"] == "nexrl-example-plugin"
    assert rows["example"]["registers"]["advantage_estimators"] == ["example.median"]
    assert rows["example"]["error"] is None


class TestMedianBaselineContract(AdvantageEstimatorContract):
    @pytest.fixture
    def estimator(self):
        return get_advantage_estimator("example.median")


def test_median_of_even_group_is_mean_of_middle_two() -> None:
    estimator = get_advantage_estimator("example.median", MedianBaselineConfig(scale=2.0))
    inputs = make_advantage_inputs([0.0, 1.0, 3.0, 10.0], ["g"] * 4)
    # median of {0, 1, 3, 10} = (1 + 3) / 2 = 2; advantages = 2 * (score - 2)
    per_row = estimator(inputs).advantages.sum(dim=1) / inputs.loss_mask.sum(dim=1)
    torch.testing.assert_close(per_row, torch.tensor([-4.0, -2.0, 2.0, 16.0]))
