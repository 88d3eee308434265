"""The entry-point module: cheap to import, registers every name, every spec builds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pluggy
import pytest

import nexrl_grpo
from nexrl_core.plugins import hookspecs
from nexrl_core.plugins.specs import AdvantageEstimatorSpec, PolicyLossSpec
from nexrl_core.training.algorithms import ADVANTAGE_INPUTS, POLICY_LOSS_INPUTS
from nexrl_grpo import plugin


def plugin_manager() -> pluggy.PluginManager:
    manager = pluggy.PluginManager(hookspecs.PROJECT)
    manager.add_hookspecs(hookspecs)
    manager.register(plugin)
    return manager


def advantage_specs() -> list[AdvantageEstimatorSpec]:
    return [spec for specs in plugin_manager().hook.nexrl_advantage_estimators() for spec in specs]


def loss_specs() -> list[PolicyLossSpec]:
    return [spec for specs in plugin_manager().hook.nexrl_policy_losses() for spec in specs]


def test_version() -> None:
    assert nexrl_grpo.__version__ == "0.1.0"


def test_importing_the_plugin_loads_neither_torch_nor_numpy() -> None:
    code = (
        "import sys, nexrl_grpo.plugin, nexrl_grpo.config\nheavy = sorted({'torch', 'numpy'} & set(sys.modules))\nassert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_registered_names() -> None:
    assert [spec.name for spec in advantage_specs()] == ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "on_policy_distillation"]
    assert [spec.name for spec in loss_specs()] == ["ppo", "importance_sampling", "cross_entropy", "cispo", "gspo", "dro"]


def test_factories_are_lazy_string_references() -> None:
    for spec in [*advantage_specs(), *loss_specs()]:
        assert isinstance(spec.factory, str) and spec.factory.startswith("nexrl_grpo."), spec.name
        assert spec.description, spec.name


@pytest.mark.parametrize("spec", advantage_specs(), ids=lambda spec: spec.name)
def test_estimator_specs_build(spec: AdvantageEstimatorSpec) -> None:
    estimator = spec.build()
    assert estimator.requires <= ADVANTAGE_INPUTS
    assert estimator.group_relative is ("group_relative" in spec.capabilities)
    assert callable(estimator)


@pytest.mark.parametrize("spec", loss_specs(), ids=lambda spec: spec.name)
def test_loss_specs_build(spec: PolicyLossSpec) -> None:
    loss = spec.build()
    assert loss.requires <= POLICY_LOSS_INPUTS
    assert callable(loss)


def test_entry_point_is_declared() -> None:
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert pyproject["project"]["entry-points"]["nexrl.plugins"] == {"grpo": "nexrl_grpo.plugin"}
