"""Recipes: defaults, YAML files, overrides, strict types, and errors that list every problem."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

from nexrl_core.config import (
    CheckFailed,
    ComponentChoice,
    ConfigError,
    DType,
    RolloutConfig,
    TrainConfig,
    apply_overrides,
    component_choices,
    dump_config,
    load_config,
    resolve_all_options,
    resolve_options,
    structure_config,
)
from nexrl_core.plugins.loading import LoadedPlugins, new_plugin_manager
from nexrl_core.plugins.registry import KINDS, Registry, reset_registry
from nexrl_core.plugins.specs import AdvantageEstimatorSpec, ComponentSpec, PolicyLossSpec


@attrs.frozen(kw_only=True)
class ClipOptions:
    clip_low: float = attrs.field(default=0.2, validator=attrs.validators.gt(0))
    stop_tokens: list[int] = attrs.field(factory=list)


def fake_registry(*specs: ComponentSpec) -> Registry:
    """A registry holding exactly ``specs``, independent of the installed plugins."""
    by_kind: dict[str, dict[str, ComponentSpec]] = {kind: {} for kind in KINDS}
    providers = {}
    for spec in specs:
        kind = next(kind for kind, spec_class in KINDS.items() if isinstance(spec, spec_class))
        by_kind[kind][spec.name] = spec
        providers[(kind, spec.name)] = "fake"
    plugins = LoadedPlugins(manager=new_plugin_manager(), infos=(), disabled=frozenset())
    return Registry(plugins=plugins, specs=by_kind, providers=providers, hook_errors={})


@pytest.fixture
def registry() -> Iterator[Registry]:
    registry = fake_registry(
        AdvantageEstimatorSpec(name="grpo", factory="unused:grpo"),
        PolicyLossSpec(name="importance_sampling", factory="unused:is"),
        PolicyLossSpec(name="clipped", factory="unused:clipped", config_class=ClipOptions),
    )
    reset_registry(registry)
    yield registry
    reset_registry()


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def problems_of(path: Path | None = None, overrides: list[str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_config(path, overrides or [])
    return caught.value.problems


# --- loading ----------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "# nothing set\n", "{}\n"])
def test_an_empty_recipe_is_the_defaults(tmp_path: Path, text: str) -> None:
    assert load_config(write(tmp_path, text)) == TrainConfig() == load_config()


def test_defaults() -> None:
    config = TrainConfig()
    # the core names no plugin: what only a plugin provides has no default
    assert config.task.name is None and config.model.name is None
    assert config.backend == ComponentChoice(name=None) and config.rollout.source == ComponentChoice(name="threads")
    assert config.model.dtype is DType.FP32 and config.model.lora.rank == 0
    assert config.algorithm.advantage == ComponentChoice(name="grpo")
    assert config.algorithm.loss == ComponentChoice(name="importance_sampling")
    assert config.algorithm.learning_rate == 1e-4 and config.algorithm.kl.coef == 0.0
    assert (config.rollout.prompts_per_step, config.rollout.group_size) == (16, 8)
    assert config.schedule.steps == 40 and config.output.dir == "runs/latest" and config.seed == 0


def test_recipe_values_are_layered_over_defaults(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "model:\n  dtype: bf16\nalgorithm:\n  learning_rate: 1e-5\n  loss:\n    name: clipped\nrollout:\n  temperature: 1\n",
    )
    config = load_config(path)
    assert config.model.dtype is DType.BF16 and config.model.name is None
    assert config.algorithm.learning_rate == 1e-5  # YAML 1.1 would read 1e-5 as a string
    assert config.algorithm.loss == ComponentChoice(name="clipped")
    assert config.rollout.temperature == 1.0 and isinstance(config.rollout.temperature, float)


def test_overrides_are_yaml_typed_and_win_over_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "rollout:\n  group_size: 4\n")
    config = load_config(
        path,
        ["rollout.group_size=2", "rollout.top_p=0.5", "task.data_path=data/train.jsonl", "model.dtype=bf16", "seed=7"],
    )
    assert config.rollout.group_size == 2 and config.rollout.top_p == 0.5
    assert config.task.data_path == "data/train.jsonl" and config.model.dtype is DType.BF16 and config.seed == 7


def test_an_option_override_keeps_the_default_component_name() -> None:
    config = load_config(None, ["algorithm.loss.options.clip_low=0.1"])
    assert config.algorithm.loss == ComponentChoice(name="importance_sampling", options={"clip_low": 0.1})


def test_apply_overrides_creates_nested_mappings_and_parses_lists_bools_and_null() -> None:
    raw = {"a": {"keep": 1}}
    result = apply_overrides(raw, ["a.b.c=[1, 2]", "a.flag=true", "x.y=null", "a.ratio=0.1", "a.name=v=1"])
    assert result == {"a": {"keep": 1, "b": {"c": [1, 2]}, "flag": True, "ratio": 0.1, "name": "v=1"}, "x": {"y": None}}
    assert raw == {"a": {"keep": 1}}


def test_malformed_overrides_are_all_reported() -> None:
    with pytest.raises(ConfigError) as caught:
        apply_overrides({"seed": 0}, ["rollout.group_size", "a..b=1", "x=[1,", "seed.deep=1"])
    assert caught.value.problems == [
        "override 'rollout.group_size': expected key.path=value, e.g. rollout.group_size=4",
        "override 'a..b=1': key path 'a..b' has an empty part",
        "override 'x=[1,': value '[1,' is not valid YAML (expected the node content, but found '<stream end>')",
        "override 'seed.deep=1': seed is 0, not a mapping, so it has no key 'deep'",
    ]


# --- errors -------------------------------------------------------------------------------


def test_unknown_key_suggests_the_closest_valid_key_with_its_full_path() -> None:
    assert problems_of(overrides=["algorithm.lerning_rate=0.1"]) == [
        "algorithm.lerning_rate: unknown key; did you mean 'learning_rate'? valid keys: advantage, beta1, beta2, "
        "eps, grad_clip_norm, kl, learning_rate, loss, lr_schedule, warmup_steps, weight_decay"
    ]
    assert problems_of(overrides=["zzz=1"])[0].startswith("zzz: unknown key; valid keys: algorithm, backend,")


@pytest.mark.parametrize(
    ("override", "problem"),
    [
        ("rollout.group_size=eight", "rollout.group_size: expected int, got 'eight' (str)"),
        ("rollout.group_size='8'", "rollout.group_size: expected int, got '8' (str)"),
        ("rollout.group_size=true", "rollout.group_size: expected int, got True (bool)"),
        ("rollout.group_size=2.5", "rollout.group_size: expected int, got 2.5 (float)"),
        ("rollout.temperature='0.7'", "rollout.temperature: expected float, got '0.7' (str)"),
        ("task.name=12", "task.name: expected str, got 12 (int)"),
        ("task.data_path=[a]", "task.data_path: expected a string or a mapping of path, builder, data_files, split, got ['a'] (list)"),
        (
            "task.data_path={path: a.jsonl, splt: x}",
            "task.data_path.splt: unknown key; did you mean 'split'? valid keys: builder, data_files, path, split",
        ),
        (
            "task.data_path={path: a, builder: json}",
            "task.data_path: set exactly one of path (a file or a save_to_disk directory) and builder (load_dataset)",
        ),
        ("rollout=3", "rollout: expected a mapping, got 3 (int)"),
        ("algorithm.loss.options=fast", "algorithm.loss.options: expected a mapping, got 'fast' (str)"),
        ("model.dtype=fp16", "model.dtype: 'fp16' is not one of: bf16, fp32"),
        ("algorithm.kl.penalty=k3", "algorithm.kl.penalty: 'k3' is not one of: abs, kl, low_var_kl, mse"),
        ("rollout.top_p=0", "rollout.top_p: must be in (0, 1], got 0.0"),
        ("backend.base_url=x", "backend.base_url: unknown key; valid keys: name, options"),
        ("task.agent=my_agent", "task.agent: must be null or look like 'package.module:function', got 'my_agent'"),
        ("rollout.max_prompt_tokens=0", "rollout.max_prompt_tokens: must be null or an integer > 0, got 0"),
        ("rollout.max_response_tokens=-8", "rollout.max_response_tokens: must be null or an integer > 0, got -8"),
        ("rollout.prompt_overflow=drop", "rollout.prompt_overflow: 'drop' is not one of: error, skip, truncate_left"),
        (
            "rollout.prompt_overflow=truncate_left",
            "rollout: prompt_overflow: truncate_left has no effect while max_prompt_tokens is null (no limit); "
            "set rollout.max_prompt_tokens or remove it",
        ),
    ],
)
def test_each_kind_of_problem_names_the_path_the_value_and_what_is_valid(override: str, problem: str) -> None:
    assert problems_of(overrides=[override]) == [problem]


def test_every_problem_is_listed_in_one_error(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "rollout:\n  group_size: 0\n  temperature: -1\n  max_tokens: eight\nmodel:\n  dtype: fp16\nschedul: {}\n",
    )
    with pytest.raises(ConfigError) as caught:
        load_config(path, ["algorithm.lerning_rate=1"])
    problems = caught.value.problems
    assert problems == [
        "model.dtype: 'fp16' is not one of: bf16, fp32",
        "algorithm.lerning_rate: unknown key; did you mean 'learning_rate'? valid keys: advantage, beta1, beta2, "
        "eps, grad_clip_norm, kl, learning_rate, loss, lr_schedule, warmup_steps, weight_decay",
        "rollout.group_size: must be a finite number > 0, got 0",
        "rollout.max_tokens: expected int, got 'eight' (str)",
        "rollout.temperature: must be a finite number > 0, got -1.0",
        "schedul: unknown key; did you mean 'schedule'? valid keys: algorithm, backend, model, output, rollout, "
        "schedule, seed, task, teacher",
    ]
    message = str(caught.value)
    assert message.startswith(f"invalid config ({path} + 1 override), 6 problems:\n  model.dtype:")
    assert isinstance(caught.value, ValueError)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="nope.yaml") as caught:
        load_config(missing)
    assert caught.value.problems == ["file not found"]


def test_a_directory_is_not_a_recipe(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the file"):
        load_config(tmp_path)


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "rollout:\n  group_size: 4\n bad: [\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.source == str(path)
    assert caught.value.problems[0].startswith("YAML syntax error at line 3")


def test_the_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="top level must be a mapping of sections .* got a list"):
        load_config(write(tmp_path, "- a\n- b\n"))


def test_direct_construction_runs_the_same_checks() -> None:
    with pytest.raises(CheckFailed, match="group_size must be a finite number > 0, got 0"):
        RolloutConfig(group_size=0)


# --- dumping ------------------------------------------------------------------------------


def test_dump_gives_plain_data_that_structures_back_to_the_same_config() -> None:
    config = load_config(None, ["model.dtype=bf16", "algorithm.kl.coef=0.1", "algorithm.kl.controller=adaptive"])
    data = dump_config(config)
    assert data["model"]["dtype"] == "bf16" and type(data["model"]["dtype"]) is str
    assert data["algorithm"]["kl"]["controller"] == "adaptive"
    assert structure_config(data, TrainConfig) == config


# --- component options --------------------------------------------------------------------


def test_component_choices_are_found_with_their_registry_kind() -> None:
    assert [(path, kind) for path, kind, _ in component_choices(TrainConfig())] == [
        ("backend", "backends"),
        ("algorithm.advantage", "advantage_estimators"),
        ("algorithm.loss", "policy_losses"),
        ("rollout.source", "rollout_sources"),
    ]


def test_options_structure_into_the_registered_config_class(registry: Registry) -> None:
    choice = ComponentChoice(name="clipped", options={"clip_low": 1, "stop_tokens": [7]})
    assert resolve_options("policy_losses", choice, "algorithm.loss") == ClipOptions(clip_low=1.0, stop_tokens=[7])
    assert resolve_options("policy_losses", ComponentChoice(name="clipped"), "algorithm.loss") == ClipOptions()


def test_option_problems_carry_the_options_path(registry: Registry) -> None:
    choice = ComponentChoice(name="clipped", options={"clip_lo": 0.1, "stop_tokens": "abc"})
    with pytest.raises(ConfigError) as caught:
        resolve_options("policy_losses", choice, "algorithm.loss")
    assert caught.value.problems == [
        "algorithm.loss.options.stop_tokens: expected a list, got 'abc' (str)",
        "algorithm.loss.options.clip_lo: unknown key; did you mean 'clip_low'? valid keys: clip_low, stop_tokens",
    ]
    with pytest.raises(ConfigError) as caught:
        resolve_options("policy_losses", ComponentChoice(name="clipped", options={"stop_tokens": [1, "x"]}), "l")
    assert caught.value.problems == ["l.options.stop_tokens[1]: expected int, got 'x' (str)"]


def test_a_plugin_validator_failure_is_reported_at_the_options_path(registry: Registry) -> None:
    with pytest.raises(ConfigError) as caught:
        resolve_options("policy_losses", ComponentChoice(name="clipped", options={"clip_low": -1}), "algorithm.loss")
    assert caught.value.problems == ["algorithm.loss.options: 'clip_low' must be > 0: -1.0"]


def test_a_component_without_options_takes_no_keys(registry: Registry) -> None:
    with pytest.raises(ConfigError) as caught:
        resolve_options("advantage_estimators", ComponentChoice(name="grpo", options={"eps": 1}), "algorithm.advantage")
    assert caught.value.problems == ["algorithm.advantage.options.eps: unknown key; it takes no keys"]


def test_every_component_problem_is_listed_at_once(registry: Registry) -> None:
    config = load_config(None, ["algorithm.advantage.name=grpoo", "algorithm.loss.name=clipped", "algorithm.loss.options.clip_low=x"])
    with pytest.raises(ConfigError) as caught:
        resolve_all_options(config)
    backend_problem, advantage_problem, loss_problem, source_problem = caught.value.problems
    assert backend_problem.startswith("backend.name: not set; choose one of the installed:")
    assert source_problem.startswith("rollout.source.name: unknown rollout source 'threads'")
    assert advantage_problem.startswith("algorithm.advantage.name: unknown advantage estimator 'grpoo'; known: grpo")
    assert "Did you mean 'grpo'?" in advantage_problem
    assert loss_problem == "algorithm.loss.options.clip_low: expected float, got 'x' (str)"


def test_resolve_all_options_fills_defaults(registry: Registry) -> None:
    config = load_config(None, ["algorithm.loss.name=clipped", "rollout.source.name=null"])
    resolved = resolve_all_options(config, require_names=False)
    assert set(resolved) == {"algorithm.advantage", "algorithm.loss"}
    assert resolved["algorithm.loss"] == ClipOptions()


def test_own_task_drops_the_registered_task_name() -> None:
    from importlib.resources import as_file, files

    with as_file(files("nexrl_core").joinpath("recipes", "quickstart.yaml")) as path:
        own = load_config(path, ["task.data_path=train.jsonl", "task.agent=my_agent:add"])
        half = load_config(path, ["task.data_path=train.jsonl"])
    assert own.task.name is None, "a user's own task must not borrow the quickstart's held-out items"
    assert half.task.name == "addition", "without an agent the registered task still provides it"
