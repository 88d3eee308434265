"""``nexrl config show``: the resolved recipe as YAML, and exit status 2 on a bad one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import yaml
from click.testing import CliRunner

from nexrl_core.commands.config import config, split_file_and_overrides
from nexrl_core.config import load_config
from nexrl_core.plugins.loading import LoadedPlugins, new_plugin_manager
from nexrl_core.plugins.registry import KINDS, Registry, reset_registry
from nexrl_core.plugins.specs import AdvantageEstimatorSpec, ComponentSpec, PolicyLossSpec, RolloutSourceSpec


@attrs.frozen(kw_only=True)
class GroupOptions:
    eps: float = 1e-6
    scale_by_std: bool = True


def install_registry(*specs: ComponentSpec) -> None:
    """Make the process-wide registry hold exactly ``specs``, whatever is installed."""
    by_kind: dict[str, dict[str, ComponentSpec]] = {kind: {} for kind in KINDS}
    for spec in specs:
        kind = next(kind for kind, spec_class in KINDS.items() if isinstance(spec, spec_class))
        by_kind[kind][spec.name] = spec
    providers = {(kind, name): "fake" for kind, names in by_kind.items() for name in names}
    plugins = LoadedPlugins(manager=new_plugin_manager(), infos=(), disabled=frozenset())
    reset_registry(Registry(plugins=plugins, specs=by_kind, providers=providers, hook_errors={}))


@pytest.fixture(autouse=True)
def registry() -> Iterator[None]:
    install_registry(
        AdvantageEstimatorSpec(name="grpo", factory="unused:grpo", config_class=GroupOptions),
        PolicyLossSpec(name="importance_sampling", factory="unused:is"),
        RolloutSourceSpec(name="threads", factory="unused:threads"),
    )
    yield
    reset_registry()


def show(*arguments: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(config, ["show", *arguments])
    return result.exit_code, result.stdout, result.stderr


def test_show_prints_the_defaults_with_component_options_resolved() -> None:
    exit_code, stdout, stderr = show()
    assert exit_code == 0, stderr
    data = yaml.safe_load(stdout)
    assert list(data) == ["task", "backend", "model", "teacher", "algorithm", "rollout", "schedule", "output", "seed"]
    assert data["teacher"] == {"model": None}
    assert data["algorithm"]["advantage"] == {"name": "grpo", "options": {"eps": 1e-6, "scale_by_std": True}}
    assert data["algorithm"]["loss"] == {"name": "importance_sampling", "options": {}}
    assert data["model"]["dtype"] == "fp32"


def test_show_applies_a_file_and_overrides(tmp_path: Path) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("rollout:\n  group_size: 4\nalgorithm:\n  advantage:\n    options:\n      eps: 0.01\n")
    exit_code, stdout, _ = show(str(recipe), "rollout.max_tokens=32")
    assert exit_code == 0
    data = yaml.safe_load(stdout)
    assert (data["rollout"]["group_size"], data["rollout"]["max_tokens"]) == (4, 32)
    assert data["algorithm"]["advantage"]["options"] == {"eps": 0.01, "scale_by_std": True}


def test_show_output_loads_back_as_the_same_recipe(tmp_path: Path) -> None:
    _, stdout, _ = show("model.dtype=bf16", "algorithm.learning_rate=3e-5")
    shown = tmp_path / "shown.yaml"
    shown.write_text(stdout)
    reloaded = load_config(shown)
    assert reloaded.algorithm.learning_rate == 3e-5
    assert show(str(shown))[1] == stdout


def test_show_without_a_file_treats_every_argument_as_an_override() -> None:
    assert split_file_and_overrides(["seed=1", "rollout.group_size=2"]) == (None, ["seed=1", "rollout.group_size=2"])
    assert split_file_and_overrides(["r.yaml", "seed=1"]) == ("r.yaml", ["seed=1"])
    assert split_file_and_overrides([]) == (None, [])
    exit_code, stdout, _ = show("seed=3")
    assert exit_code == 0 and yaml.safe_load(stdout)["seed"] == 3


def test_show_exits_2_listing_every_problem_on_stderr() -> None:
    exit_code, stdout, stderr = show("rollout.group_size=eight", "algorithm.lerning_rate=1")
    assert exit_code == 2
    assert stdout == ""
    assert "rollout.group_size: expected int, got 'eight' (str)" in stderr
    assert "algorithm.lerning_rate: unknown key; did you mean 'learning_rate'?" in stderr


def test_show_exits_2_on_bad_component_options_and_a_missing_file(tmp_path: Path) -> None:
    exit_code, _, stderr = show("algorithm.advantage.options.epss=1")
    assert exit_code == 2
    assert "algorithm.advantage.options.epss: unknown key; did you mean 'eps'?" in stderr

    exit_code, _, stderr = show(str(tmp_path / "missing.yaml"))
    assert exit_code == 2
    assert "missing.yaml" in stderr and "file not found" in stderr
