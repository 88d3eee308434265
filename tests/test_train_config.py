"""The recipe keys the training loop added: checked strictly, with the key path."""

from __future__ import annotations

from importlib.resources import files

import pytest

from nexrl_core.config import ConfigError, TrainConfig, load_config


def problems(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_config(None, list(overrides))
    return caught.value.problems


def test_new_defaults() -> None:
    config = TrainConfig()
    assert config.task.val_size is None
    assert config.backend.name is None and config.backend.options == {}
    assert config.rollout.max_agent_errors is None and config.rollout.val_temperature == 1.0
    assert config.rollout.max_staleness == 0 and config.rollout.error_budget == 0.1


def test_new_keys_take_values() -> None:
    config = load_config(
        None,
        [
            "task.val_size=50",
            "backend.name=remote_api",
            "backend.options={renderer: qwen3, timeout_s: 30}",
            "rollout.max_agent_errors=0",
            "rollout.val_temperature=0",
            "rollout.max_staleness=1",
        ],
    )
    assert config.task.val_size == 50 and config.backend.name == "remote_api"
    assert config.backend.options == {"renderer": "qwen3", "timeout_s": 30}
    assert config.rollout.max_agent_errors == 0 and config.rollout.val_temperature == 0.0
    assert config.rollout.max_staleness == 1


def test_new_keys_are_strict() -> None:
    assert problems(
        "task.val_size=0",
        "backend.name=''",
        "backend.options=[1]",
        "rollout.max_agent_errors=-1",
        "rollout.val_temperature=-0.5",
        "rollout.error_budget=2",
    ) == [
        "task.val_size: must be null or an integer > 0, got 0",
        "backend.name: must be null or a non-empty string, got ''",
        "backend.options: expected a mapping, got [1] (list)",
        "rollout.error_budget: must be in [0, 1], got 2.0",
        "rollout.max_agent_errors: must be null or an integer >= 0, got -1",
        "rollout.val_temperature: must be a finite number >= 0, got -0.5",
    ]


def test_concurrency_defaults_to_a_whole_step_in_flight() -> None:
    assert TrainConfig().rollout.concurrency is None
    assert TrainConfig().rollout.runs_in_flight() == 16 * 8
    assert load_config(None, ["rollout.prompts_per_step=4", "rollout.group_size=3"]).rollout.runs_in_flight() == 12
    assert load_config(None, ["rollout.prompts_per_step=64", "rollout.group_size=16"]).rollout.runs_in_flight() == 256
    assert load_config(None, ["rollout.concurrency=5"]).rollout.runs_in_flight() == 5
    assert problems("rollout.concurrency=0") == ["rollout.concurrency: must be null or an integer > 0, got 0"]


def test_the_quickstart_recipe_ships_and_loads() -> None:
    recipe = files("nexrl_core").joinpath("recipes", "quickstart.yaml")
    config = load_config(str(recipe))
    assert config.task.name == "addition" and config.backend.name == "remote_api"
    assert config.backend.options == {"service_holder": "tinker", "base_url": None, "trainer": "remote_api_grpo"}
    assert config.model.name == "nexrl-tiny" and config.output.dir == "runs/quickstart"
    assert config.rollout.runs_in_flight() == config.rollout.prompts_per_step * config.rollout.group_size
