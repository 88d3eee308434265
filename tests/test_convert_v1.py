"""``nexrl convert-v1``: NexRL v1 recipes of each shape, converted, shown and run.

The v1 recipes in ``tests/data/v1`` are one per shape: ``design`` (the design documents'
``trainer.train_service`` with a separate worker training-config file), ``flat`` (v1's
``service.train_service`` with ``resource.*``, composed from ``common.yaml``) and
``nested`` (v1.4's ``service.train_service.<name>`` with ``role`` and ``config``). Each
one's conversion is golden (``expected.yaml``: the recipe; ``expected_lists.yaml``: every
carried, dropped, not-supported and choose line); ``NEXRL_UPDATE_GOLDEN=1`` rewrites
them after an intended change, for review in the diff.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from nexrl_core.cli import cli
from nexrl_core.config import ConfigError, load_config
from nexrl_core.config.env_refs import resolve_env_refs
from nexrl_core.plugins.registry import reset_registry
from nexrl_core.v1.compose import V1RecipeError, read_v1_recipe
from nexrl_core.v1.convert import Conversion, convert_v1_recipe
from nexrl_core.v1.docs import render_page
from nexrl_core.v1.rules import RULES
from nexrl_core.v1.table import Fate, key_table

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "v1"
NEXRL = str(Path(sys.executable).with_name("nexrl"))
SHAPES = {"design": DATA / "design" / "recipe.yaml", "v1": DATA / "flat" / "self_hosted.yaml", "v1.4": DATA / "nested" / "tinker.yaml"}
ENV = {
    "NEXRL_V1_DATA": "/data/v1",
    "NEXRL_V1_MODEL_PATH": "/models",
    "API_SERVER_HOST": "10.0.0.1",
    "API_SERVER_URL": "10.0.0.2",
    "TINKER_API_KEY": "tml-not-a-real-key",
}
"""What the fixtures' environment references need for `nexrl config show`."""


@pytest.fixture
def v1_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)


def lines(conversion: Conversion) -> dict[str, list[str]]:
    return {name: [item.line() for item in getattr(conversion, name)] for name in ("carried", "dropped", "unsupported", "choose")}


# --- environment references in NexRL's own recipes ------------------------------------------------


def test_environment_references_resolve_when_the_recipe_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "task:\n  data_path: ${oc.env:NEXRL_TEST_DATA}/train.jsonl\n"
        "schedule:\n  steps: ${oc.env:NEXRL_TEST_STEPS,7}\n  validate_every: ${oc.env:NEXRL_TEST_EVERY,'3'}\n"
        "output:\n  dir: runs/\\${literal}\n"
    )
    monkeypatch.setenv("NEXRL_TEST_DATA", "/srv/data")
    monkeypatch.delenv("NEXRL_TEST_STEPS", raising=False)
    monkeypatch.delenv("NEXRL_TEST_EVERY", raising=False)
    config = load_config(recipe)
    assert config.task.data_path == "/srv/data/train.jsonl"
    assert config.schedule.steps == 7, "a value that is one reference is read as YAML, like an override"
    assert config.schedule.validate_every == 3, "a quoted default loses its quotes"
    assert config.output.dir == "runs/${literal}", "\\${ is a literal ${"
    monkeypatch.setenv("NEXRL_TEST_STEPS", "12")
    assert load_config(recipe).schedule.steps == 12


def test_an_unset_variable_without_default_names_the_key_and_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("task:\n  data_path: ${oc.env:NEXRL_TEST_UNSET}/train.jsonl\n")
    monkeypatch.delenv("NEXRL_TEST_UNSET", raising=False)
    with pytest.raises(ConfigError) as error:
        load_config(recipe)
    assert "task.data_path: environment variable NEXRL_TEST_UNSET is not set" in str(error.value)
    assert load_config(recipe, ["task.data_path=/here.jsonl"]).task.data_path == "/here.jsonl", "an override replaces it first"


def test_other_interpolations_are_left_alone() -> None:
    assert resolve_env_refs({"a": "${not.ours}", "b": ["x"]}, environ={}) == {"a": "${not.ours}", "b": ["x"]}


# --- reading v1 recipes as Hydra and OmegaConf did -----------------------------------------------------


def test_defaults_compose_in_order_with_self_last_unless_placed(tmp_path: Path) -> None:
    (tmp_path / "common.yaml").write_text("a: 1\nb: {x: 1, y: 1}\nl: [1, 2]\n")
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "fast.yaml").write_text("steps: 5\n")
    (tmp_path / "last.yaml").write_text("defaults: [common]\na: 2\nb: {y: 2}\nl: [3]\n")
    (tmp_path / "first.yaml").write_text("defaults: [_self_, common, {trainer: fast}, {optional missing: none}]\na: 2\n")
    assert read_v1_recipe(tmp_path / "last.yaml") == {"a": 2, "b": {"x": 1, "y": 2}, "l": [3]}, "lists replace, mappings merge"
    assert read_v1_recipe(tmp_path / "first.yaml") == {"a": 1, "b": {"x": 1, "y": 1}, "l": [1, 2], "trainer": {"steps": 5}}


def test_interpolations_resolve_absolute_relative_and_inside_strings_and_keep_environment_references(tmp_path: Path) -> None:
    (tmp_path / "recipe.yaml").write_text(
        "data: {n: 8, path: '${oc.env:DATA,/d}/x', copy: '${.n}', up: '${..top}'}\n"
        "top: {k: 1}\nwhole: ${data.n}\ntext: 'n=${data.n}'\nvia: ${data.path}\n"
    )
    assert read_v1_recipe(tmp_path / "recipe.yaml") == {
        "data": {"n": 8, "path": "${oc.env:DATA,/d}/x", "copy": 8, "up": {"k": 1}},
        "top": {"k": 1},
        "whole": 8,
        "text": "n=8",
        "via": "${oc.env:DATA,/d}/x",
    }


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a: ${b}\nb: ${a}\n", "interpolation loop"),
        ("a: ${nope.x}\n", "a: ${nope.x} names a key the recipe does not have"),
        ("a: ${now:%H}\n", "uses a resolver"),
        ("defaults: [missing]\n", "does not exist"),
        ("defaults: [{override trainer: x}]\n", "is not supported"),
    ],
)
def test_what_v1_could_read_and_this_reader_cannot_is_refused_by_name(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "recipe.yaml").write_text(text)
    with pytest.raises(V1RecipeError, match=re.escape(message)):
        read_v1_recipe(tmp_path / "recipe.yaml")


# --- the key table --------------------------------------------------------------------------------------


def test_the_table_names_only_rules_that_exist_and_every_rule_is_named() -> None:
    named = {row.rule for row in key_table().rules if row.fate is Fate.RULE}
    assert named == set(RULES)


def test_every_nexrl_key_the_table_writes_is_a_recipe_key_whose_effect_is_tested() -> None:
    """A carried value is only as good as the key it reaches: each NexRL key in the table
    has an entry in test_recipe_keys.py, whose tests show it changing the run."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from test_recipe_keys import KEYS  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(ROOT / "tests"))
    known = {key.split(" [")[0] for key in KEYS}
    written = {new for row in key_table().rules for new in row.new}
    assert sorted(written - known) == []


def test_the_page_is_what_the_table_renders() -> None:
    page = (ROOT / "docs" / "coming-from-v1.md").read_text()
    assert page == render_page(), "regenerate it: python -m nexrl_core.v1.docs > docs/coming-from-v1.md"
    assert "(docs/coming-from-v1.md)" in (ROOT / "README.md").read_text()


# --- golden conversions ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_golden_conversion(shape: str) -> None:
    conversion = convert_v1_recipe(SHAPES[shape])
    assert conversion.shape == shape
    recipe_file, lists_file = SHAPES[shape].parent / "expected.yaml", SHAPES[shape].parent / "expected_lists.yaml"
    if os.environ.get("NEXRL_UPDATE_GOLDEN"):
        recipe_file.write_text(conversion.to_yaml())
        lists_file.write_text(yaml.safe_dump(lines(conversion), sort_keys=False, width=1_000_000, allow_unicode=True))
    assert conversion.to_yaml() == recipe_file.read_text()
    assert lines(conversion) == yaml.safe_load(lists_file.read_text())


def dropped_keys(conversion: Conversion) -> list[str]:
    return [item.v1 for item in conversion.dropped]


def test_design_shape_lists() -> None:
    conversion = convert_v1_recipe(SHAPES["design"])
    worker = "configs/train_config.yaml:actor."
    assert lines(conversion)["unsupported"] == [
        f"{worker}use_kl_loss = true: a KL term in the loss (NexRL puts KL in the reward, algorithm.kl); instead: set algorithm.kl.coef for a KL penalty in the reward",
        "rollout_worker.agent_cls = single_turn_math: v1's built-in agent single_turn_math; instead: write it as an agent function "
        "(examples/math/math_agent.py does single_turn_math's job: copy it beside the recipe) and pass --agent math_agent:solve (task.agent)",
    ]
    assert dropped_keys(conversion) == [
        "trainer.max_prompt_length", "trainer.max_response_length", "trainer.algorithm.inference_service.tokenizer", "data.type",
        "trainer.train_service.config.zmq_total_timeout_ms", "trainer.train_service.training_config_path",
        f"{worker}model.use_liger", f"{worker}fsdp_config.fsdp_size", f"{worker}fsdp_config.param_offload", f"{worker}kl_loss_coef",
        f"{worker}ulysses_sequence_parallel_size", "data.max_prompt_length", "rollout_worker.type", "weight.staleness_threshold",
        "trainer.algorithm.inference_service.model", f"{worker}clip_ratio", f"{worker}use_dynamic_bsz",
    ]  # fmt: skip
    assert [item.v1 for item in conversion.choose] == ["trainer.algorithm.use_kl_in_reward", f"{worker}loss_agg_mode"]
    assert conversion.recipe["algorithm"]["kl"] == {
        "coef": 0.05,
        "penalty": "low_var_kl",
        "controller": "adaptive",
        "target": 4.0,
        "horizon": 500,
    }


def test_flat_shape_lists() -> None:
    conversion = convert_v1_recipe(SHAPES["v1"])
    actor = "service.train_service.actor."
    assert lines(conversion)["unsupported"] == [
        f"{actor}ulysses_sequence_parallel_size = 2: Ulysses sequence parallelism (each sequence split across GPUs); instead: NexRL shards "
        "with FSDP only; bound memory with backend.options.update.max_tokens_per_microbatch and model.gradient_checkpointing",
        "rollout_worker.agent_cls = single_turn_math: v1's built-in agent single_turn_math; instead: write it as an agent function "
        "(examples/math/math_agent.py does single_turn_math's job: copy it beside the recipe) and pass --agent math_agent:solve (task.agent)",
        f"{actor}ppo_mini_batch_size = 3: v1 split each step's 4 prompts into optimizer steps of 3 and one of 1; NexRL splits a step into "
        "equal parts; instead: set backend.options.update.mini_batches (2 is closest) or make data.batch_size a multiple of it",
    ]
    resources = [f"resource.train.flat-group.{key}" for key in ("world_size", "gpus_per_pod", "memory_per_gpu")]
    resources += [f"resource.inference.{key}" for key in ("backend", "replicas", "gpus_per_replica", "served_model_name", "model_path")]
    assert dropped_keys(conversion) == [
        "project_name", "launch_mode", "multi_model", "logger.backend", "logger.enable_feishu_logging", "logger.feishu_url", "resume.mode",
        "resume.resume_path", "data.type", "data.keep_batch_order", "data.max_response_length", "data.tokenizer_path", "data.shuffle",
        "data.drop_last", "rollout_worker.need_llm_inference", "rollout_worker.agent.math.judge_mode", "rollout_worker.max_response_length",
        "trajectory_pool.type", "trajectory_pool.batch_size", "trajectory_pool.group_size", "trajectory_pool.key_list",
        "trajectory_pool.check_batch_ready_function", "trainer.checkpoint_path", "trainer.sync_weight_path",
        "service.inference_service.model_tag", "service.inference_service.api_key", "service.inference_service.base_url",
        "service.inference_service.model", "service.inference_service.tokenizer", "service.inference_service.backend",
        "service.inference_service.max_retries", "service.inference_service.freeze_for_weight_sync", "service.inference_service.weight_type",
        "weight.type", "weight.sync_method", "weight.sync_weight_path", "validate.validate_before_train", "validate.data.seed",
        "validate.data.batch_size", "validate.eval.type", "validate.eval.validate_freq", *resources, f"{actor}checkpoint_manager",
        f"{actor}model.use_remove_padding", f"{actor}clip_ratio_c", f"{actor}use_kl_loss", f"{actor}kl_loss_type", f"{actor}kl_loss_coef",
        f"{actor}use_ring_sequence_parallel", f"{actor}fsdp_config.wrap_policy.min_num_params", f"{actor}fsdp_config.param_offload",
        f"{actor}fsdp_config.fsdp_size", f"{actor}rollout.temperature", f"{actor}rollout.n", "validate.data.type", "rollout_worker.type",
        "weight.sync_mode", "trainer.algorithm.kl_ctrl.kl_coef", f"{actor}clip_ratio_low", f"{actor}clip_ratio_high", f"{actor}loss_agg_mode",
        f"{actor}use_dynamic_bsz", f"{actor}ppo_max_token_len_per_gpu",
    ]  # fmt: skip
    (kl,) = [item for item in conversion.choose if item.v1 == "trainer.algorithm.use_kl_in_reward"]
    assert "v1 read kl_ctrl only under trainer.algorithm.critic" in kl.text and "set algorithm.kl.coef: 0 to train as v1 did" in kl.text
    assert conversion.recipe["algorithm"]["kl"] == {"coef": 0.002, "penalty": "kl", "controller": "fixed"}, "the KL the recipe meant"


def test_nested_shape_lists() -> None:
    conversion = convert_v1_recipe(SHAPES["v1.4"])
    assert lines(conversion)["unsupported"] == [
        "rollout_worker.agent_cls = single_turn_math: v1's built-in agent single_turn_math; instead: write it as an agent function "
        "(examples/math/math_agent.py does single_turn_math's job: copy it beside the recipe) and pass --agent math_agent:solve (task.agent)",
    ]
    assert dropped_keys(conversion) == [
        "project_name", "launch_mode", "data.type", "data.max_response_length", "data.shuffle", "rollout_worker.max_response_length",
        "weight.type", "weight.sync_method", "validate.validate_before_train", "validate.eval.validate_freq",
        "service.inference_service.identifier", "service.inference_service.backend", "service.inference_service.freeze_for_weight_sync",
        "service.inference_service.weight_type", "service.train_service.student.identifier", "service.train_service.student.role",
        "validate.data.type", "validate.data.data_files", "data.max_prompt_length", "data.filter_prompts", "rollout_worker.type",
        "rollout_worker.max_sequence_length", "weight.staleness_threshold", "service.train_service.teacher.identifier",
        "service.train_service.teacher.role", "service.train_service.teacher.backend", "service.train_service.teacher.config.model",
    ]  # fmt: skip
    assert "teacher" not in conversion.recipe, "v1's remote_api_grpo read no teacher"
    backend = conversion.recipe["backend"]
    assert backend["options"]["base_url"] == "https://tinker.thinkingmachines.dev/services/tinker-prod", "null meant the hosted service"
    assert backend["options"]["api_key_env"] == "TINKER_API_KEY"
    assert conversion.recipe["model"]["lora"] == {"rank": 32}, "v1's LoRA rank, not NexRL's full fine-tuning"
    assert conversion.recipe["algorithm"]["weight_decay"] == 0.05 and conversion.recipe["algorithm"]["grad_clip_norm"] == 0.0
    assert [item.v1 for item in conversion.choose] == ["service.train_service.student.config.weight_decay"]


@pytest.mark.parametrize("shape", SHAPES)
def test_nexrl_config_show_accepts_each_conversion(shape: str, tmp_path: Path, v1_env: None) -> None:
    out = tmp_path / "recipe.yaml"
    runner = CliRunner()
    converted = runner.invoke(cli, ["convert-v1", str(SHAPES[shape]), "--agent", "math_agent:solve", "--drop-unsupported", "-o", str(out)])
    assert converted.exit_code == 0, converted.output
    shown = runner.invoke(cli, ["config", "show", str(out)])
    assert shown.exit_code == 0, shown.output
    data = yaml.safe_load(shown.stdout)
    assert data["task"]["agent"] == "math_agent:solve"
    assert "/data/v1" in json.dumps(data["task"]["data_path"]), "the data path's environment reference resolved when loaded"


# --- the command ------------------------------------------------------------------------------------------


def test_a_key_that_changes_training_without_equivalent_stops_the_conversion(tmp_path: Path) -> None:
    out = tmp_path / "recipe.yaml"
    result = CliRunner().invoke(cli, ["convert-v1", str(SHAPES["v1.4"]), "-o", str(out)])
    assert result.exit_code == 2
    assert "rollout_worker.agent_cls = single_turn_math: v1's built-in agent" in result.stderr
    assert "not converted: 1 key changes training in a way NexRL cannot" in result.stderr
    assert not out.exists()


def test_everything_carried_exits_0_with_the_lists(tmp_path: Path) -> None:
    (tmp_path / "common.yaml").write_text((DATA / "nested" / "common.yaml").read_text())
    recipe = yaml.safe_load((SHAPES["v1.4"]).read_text())
    del recipe["service"]["train_service"]["teacher"]
    (tmp_path / "tinker.yaml").write_text(yaml.safe_dump(recipe))
    result = CliRunner().invoke(cli, ["convert-v1", str(tmp_path / "tinker.yaml"), "--agent", "math_agent:solve"])
    assert result.exit_code == 0, result.output
    assert "rollout_worker.agent_cls -> task.agent = math_agent:solve" in result.stderr
    assert "dropped (no meaning here):" in result.stderr and "not supported" not in result.stderr
    assert result.stdout.startswith("# Converted from the NexRL v1 recipe")
    assert "#   service.train_service.student.config.weight_decay: v1 never sent this" in result.stdout, "the choice heads the file"


def distillation_recipe(tmp_path: Path, *, trainer: str = "remote_api_opd", **student_config: object) -> dict:
    """The nested fixture under v1's OPD trainer: its teacher service scores, the student's config takes ``student_config``."""
    (tmp_path / "common.yaml").write_text((DATA / "nested" / "common.yaml").read_text())
    recipe = yaml.safe_load((SHAPES["v1.4"]).read_text())
    recipe["trainer"]["type"] = trainer
    recipe["service"]["train_service"]["student"]["config"].update(student_config)
    return recipe


def convert(tmp_path: Path, recipe: dict) -> Conversion:
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return convert_v1_recipe(tmp_path / "recipe.yaml")


def test_a_v1_distillation_recipe_becomes_a_teacher_and_the_distillation_estimator(tmp_path: Path, v1_env: None) -> None:
    """v1.4's Tinker OPD: the teacher service's model is teacher.model, the advantage the teacher's reverse KL alone,
    kl_penalty_coef and kl_discount_factor its weight and discount; `nexrl config show` takes the recipe."""
    conversion = convert(tmp_path, distillation_recipe(tmp_path, kl_penalty_coef=0.5, kl_discount_factor=0.9))
    assert conversion.recipe["teacher"] == {"model": "Qwen/Qwen3-8B"}
    assert conversion.recipe["algorithm"]["advantage"] == {
        "name": "on_policy_distillation",
        "options": {"task_advantage": "none", "kl_coef": 0.5, "kl_discount": 0.9},
    }
    assert conversion.recipe["backend"]["options"]["trainer"] == "remote_api_grpo"
    assert [line for line in lines(conversion)["unsupported"] if "teacher" in line] == []
    out = tmp_path / "converted.yaml"
    out.write_text(conversion.to_yaml())
    shown = CliRunner().invoke(cli, ["config", "show", str(out)])
    assert shown.exit_code == 0, shown.output
    assert yaml.safe_load(shown.stdout)["algorithm"]["advantage"]["options"]["kl_coef"] == 0.5


def test_v1s_default_weight_is_written_and_trainer_teachers_names_the_teacher(tmp_path: Path) -> None:
    recipe = distillation_recipe(tmp_path)
    del recipe["service"]["train_service"]["teacher"]
    recipe["trainer"]["teachers"] = [{"base_model": "Qwen/Qwen3-8B", "checkpoint": None}]
    conversion = convert(tmp_path, recipe)
    assert conversion.recipe["teacher"] == {"model": "Qwen/Qwen3-8B"}
    assert conversion.recipe["algorithm"]["advantage"]["options"] == {"task_advantage": "none", "kl_coef": 1.0, "kl_discount": 0.0}
    assert (
        "service.train_service.student.config.kl_penalty_coef (v1 default) -> algorithm.advantage.options.kl_coef = 1.0"
        in lines(conversion)["carried"]
    )


def self_hosted_distillation(tmp_path: Path, *, url: str | None = None) -> dict:
    """A v1.4 self_hosted_opd recipe: a student of 2 pods x 2 GPUs and a teacher of 1 x 3, each its own service."""
    recipe = distillation_recipe(tmp_path, trainer="self_hosted_opd")
    del recipe["service"]["tinker_service"], recipe["weight"]
    student = {"identifier": "student", "role": "actor", "backend": "direct-zmq", "resource": {"world_size": 2, "gpus_per_pod": 2}}
    teacher = {"identifier": "teacher", "role": "teacher", "backend": "direct-zmq", "resource": {"world_size": 1, "gpus_per_pod": 3}}
    student["actor"], teacher["actor"] = (
        {"model": {"path": "/models/student"}},
        {"model": {"path": "/models/teacher"}, "optim": {"lr": 1e-6}},
    )
    if url is not None:
        student["url"] = teacher["url"] = url
    recipe["service"]["train_service"] = {"student": student, "teacher": teacher}
    recipe["trainer"]["algorithm"] = {"distillation_coeff": 2.0}
    return recipe


def test_a_self_hosted_teacher_gets_its_own_ranks_and_its_training_settings_are_dropped(tmp_path: Path) -> None:
    conversion = convert(tmp_path, self_hosted_distillation(tmp_path))
    options = conversion.recipe["backend"]["options"]
    assert (options["world_size"], options["teacher_world_size"]) == (4, 3)
    assert conversion.recipe["teacher"] == {"model": "/models/teacher"}
    assert conversion.recipe["model"]["name"] == "/models/student"
    assert conversion.recipe["algorithm"]["advantage"]["options"]["kl_coef"] == 2.0
    assert "service.train_service.teacher.actor.optim.lr" in dropped_keys(conversion), "the frozen teacher trains nothing"


@pytest.mark.parametrize(
    ("change", "refused", "says"),
    [
        ("url", "service.train_service.teacher.actor.model.path", "remove both services' url"),
        ("two entries", "trainer.teachers", "one teacher, and this is 2"),
        ("a checkpoint", "trainer.teachers", "export the checkpoint's weights"),
        ("no teacher", "trainer.type", "the recipe names none"),
        ("another backend", "service.train_service.teacher.config.model", "give both one backend"),
        ("weaver", "service.train_service.teacher.config.model", "holds no teacher"),
    ],
)
def test_a_teacher_nexrl_cannot_hold_is_refused_by_its_key(tmp_path: Path, change: str, refused: str, says: str) -> None:
    recipe = self_hosted_distillation(tmp_path, url="http://10.0.0.1:8000") if change == "url" else distillation_recipe(tmp_path)
    services = recipe["service"]["train_service"]
    if change in ("two entries", "a checkpoint", "no teacher"):
        del services["teacher"]
        entries = {
            "two entries": ["Qwen/Qwen3-8B", "Qwen/Qwen3-4B"],
            "a checkpoint": [{"base_model": "Qwen/Qwen3-8B", "checkpoint": "tinker://x"}],
        }
        if change in entries:
            recipe["trainer"]["teachers"] = entries[change]
    elif change == "another backend":
        services["teacher"]["backend"] = "weaver"
    elif change == "weaver":
        for service in services.values():
            service["backend"] = "weaver"
        recipe["service"]["weaver_service"] = recipe["service"].pop("tinker_service")
        recipe["weight"]["sync_method"] = "weaver"
    conversion = convert(tmp_path, recipe)
    (line,) = [line for line in lines(conversion)["unsupported"] if line.startswith(refused + " = ")]
    assert says in line
    assert "teacher" not in conversion.recipe
    assert conversion.recipe["algorithm"]["advantage"]["name"] == "grpo"


def test_an_unknown_key_is_named(tmp_path: Path) -> None:
    recipe = yaml.safe_load((DATA / "nested" / "common.yaml").read_text())
    (tmp_path / "common.yaml").write_text(yaml.safe_dump(recipe))
    text = (SHAPES["v1.4"]).read_text().replace("  type: remote_api_grpo\n", "  type: remote_api_grpo\n  totl_train_steps: 5\n")
    (tmp_path / "tinker.yaml").write_text(text + "\nmystery:\n  knob: 1\n")
    result = CliRunner().invoke(cli, ["convert-v1", str(tmp_path / "tinker.yaml")])
    assert result.exit_code == 2
    assert "unknown v1 key trainer.totl_train_steps" in result.stderr
    assert "unknown v1 key mystery.knob" in result.stderr


def test_a_key_written_in_the_recipe_is_never_written_out(tmp_path: Path) -> None:
    (tmp_path / "common.yaml").write_text((DATA / "nested" / "common.yaml").read_text())
    literal = (SHAPES["v1.4"]).read_text().replace('api_key: "${oc.env:TINKER_API_KEY}"', "api_key: tml-SECRET-literal")
    (tmp_path / "literal.yaml").write_text(literal)
    defaulted = (
        (SHAPES["v1.4"]).read_text().replace('api_key: "${oc.env:TINKER_API_KEY}"', 'api_key: "${oc.env:MY_KEY,tml-SECRET-default}"')
    )
    (tmp_path / "defaulted.yaml").write_text(defaulted)
    for name, variable in (("literal", "TINKER_API_KEY"), ("defaulted", "MY_KEY")):
        result = CliRunner().invoke(cli, ["convert-v1", str(tmp_path / f"{name}.yaml"), "--drop-unsupported"])
        assert result.exit_code == 0, result.output
        assert "SECRET" not in result.stdout and "SECRET" not in result.stderr
        assert yaml.safe_load(result.stdout)["backend"]["options"]["api_key_env"] == variable


# --- runs -------------------------------------------------------------------------------------------------

RUN_OVERRIDES = ["task.name=addition", "task.data_path=null", "task.val_data_path=null", "task.columns=null", "model.name=nexrl-tiny"]
"""The tiny model and its task in place of the fixtures' model and data."""


def convert_and_train(shape: str, tmp_path: Path, *overrides: str) -> tuple[dict, list[dict]]:
    recipe, out = tmp_path / "recipe.yaml", tmp_path / "run"
    convert = subprocess.run(
        [NEXRL, "convert-v1", str(SHAPES[shape]), "--drop-unsupported", "-o", str(recipe)], capture_output=True, text=True, timeout=60
    )
    assert convert.returncode == 0, convert.stderr
    env = {**os.environ, **ENV}
    command = [NEXRL, "train", str(recipe), *RUN_OVERRIDES, *overrides, f"output.dir={out}", "--no-progress"]
    completed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return yaml.safe_load((out / "config.yaml").read_text()), rows


@pytest.mark.slow
def test_a_converted_nested_recipe_trains_two_steps_on_the_embedded_service(tmp_path: Path) -> None:
    config, rows = convert_and_train("v1.4", tmp_path, "backend.options.base_url=null", "backend.options.api_key_env=null")
    assert [row["step"] for row in rows] == [1, 2]
    assert all(row["rollout/runs"] == 16 and row["optim/lr"] == pytest.approx(4e-5) for row in rows), "4 prompts x 4 runs, v1's rate"
    assert config["model"]["lora"]["rank"] == 32 and config["algorithm"]["weight_decay"] == 0.05
    assert config["algorithm"]["loss"]["options"]["agg_mode"] == "token-sum"


V1_WORKER_LINE = (
    "torchrun --standalone --nproc_per_node=2 -m nexrl.train_service_backend.distributed.worker_process "
    "--identifier actor-group --backend fsdp --dispatch-mode scatter"
)
"""The seed's worker line with v1's dispatch mode, the API server left to ``API_SERVER_URL``."""


@pytest.mark.slow
def test_a_converted_design_recipe_trains_to_its_last_step_on_ranks_the_v1_worker_line_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """v1's self-hosted launch, converted: ``nexrl serve workers``, then the ranks from what
    ``convert-v1 --launch`` prints for `V1_WORKER_LINE` (``--backend fsdp --dispatch-mode
    scatter``, the server a bare ``host:port`` in ``API_SERVER_URL``), then the converted
    recipe trained to its last step through its ``workers_url``; the run's end destroys the
    group and every rank exits."""
    from nexrl_fsdp.direct_zmq.group_key import ENV_WORKER_KEY, new_group_key
    from nexrl_testing.served_runs import serving

    monkeypatch.setenv(ENV_WORKER_KEY, new_group_key())
    converted = subprocess.run([NEXRL, "convert-v1", "--launch", V1_WORKER_LINE], capture_output=True, text=True, timeout=60)
    assert converted.returncode == 0, converted.stderr
    (line,) = converted.stdout.splitlines()
    torchrun, *args = shlex.split(line)
    assert torchrun == "torchrun" and "--api-server-url" not in args and args[-4:] == ["--backend", "fsdp", "--dispatch-mode", "scatter"]
    log = open(tmp_path / "ranks.log", "wb")  # noqa: SIM115 - closed below
    ranks = None
    try:
        with serving("workers", tmp_path / "server", keeps_files=False) as url:
            env = {**os.environ, "OMP_NUM_THREADS": "1", "API_SERVER_URL": url.removeprefix("http://")}
            launcher = [sys.executable, "-m", "torch.distributed.run"]
            ranks = subprocess.Popen([*launcher, *args], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            config, rows = convert_and_train("design", tmp_path, f"backend.options.workers_url={url}")
            assert ranks.wait(timeout=120) == 0, "the run's end destroys the group, and its ranks end"
    finally:
        if ranks is not None and ranks.poll() is None:
            ranks.terminate()
            ranks.wait(timeout=30)
        log.close()
    assert [row["step"] for row in rows] == [1, 2]
    assert all(row["rollout/runs"] == 16 for row in rows)
    assert config["backend"]["options"]["identifier"] == "actor-group" and config["backend"]["options"]["world_size"] == 2
    assert config["backend"]["options"]["update"] | {"max_tokens_per_microbatch": None} == {
        "ppo_epochs": 2, "mini_batches": 2, "micro_batch_rows": 2, "max_tokens_per_microbatch": None
    }  # fmt: skip
    assert config["algorithm"]["kl"]["controller"] == "adaptive" and config["model"]["dtype"] == "bf16"


# --- launch lines ------------------------------------------------------------------------------------

SEED_WORKER_LINE = """torchrun --nproc_per_node=8 \\
    -m nexrl.train_service_backend.distributed.worker_process \\
    --api-server-url http://localhost:8000 \\
    --identifier actor-group \\
    --backend fsdp"""
"""The design document's worker line, as it is written there."""

LAUNCH_GOLDEN = {
    "python -m nexrl.main --config-path=recipe/math --config-name=self_hosted": [
        "nexrl convert-v1 recipe/math/self_hosted.yaml -o self_hosted.yaml",
        "nexrl train self_hosted.yaml",
    ],
    "NEXRL_V1_DATA=/data python3 -m nexrl.main -cp recipe -cn math/tinker.yaml": [
        "nexrl convert-v1 recipe/math/tinker.yaml -o tinker.yaml",
        "NEXRL_V1_DATA=/data nexrl train tinker.yaml",
    ],
    "python -m nexrl.train_service_backend.api.api_server --host 0.0.0.0 --port=8000": ["nexrl serve workers --host 0.0.0.0 --port 8000"],
    SEED_WORKER_LINE: [
        "torchrun --nproc_per_node=8 -m nexrl_fsdp.worker --api-server-url http://localhost:8000 --identifier actor-group --backend fsdp"
    ],
    "API_SERVER_URL=10.0.0.1 torchrun --standalone --nproc_per_node=1 -m nexrl.train_service_backend.distributed.worker_process "
    "--identifier=actor-group --backend=fsdp --dispatch-mode=scatter": [
        "API_SERVER_URL=10.0.0.1 torchrun --standalone --nproc_per_node=1 -m nexrl_fsdp.worker --identifier actor-group --backend fsdp --dispatch-mode scatter"
    ],
    "python -m torch.distributed.run --nnodes 2 --rdzv-endpoint=h:29400 /opt/nexrl/distributed/worker_process.py --identifier 'a b'": [
        "python -m torch.distributed.run --nnodes 2 --rdzv-endpoint=h:29400 -m nexrl_fsdp.worker --identifier 'a b'"
    ],
}
"""v1 launch lines and the NexRL lines `nexrl convert-v1 --launch` prints for each."""


@pytest.mark.parametrize("line", LAUNCH_GOLDEN)
def test_a_v1_launch_line_becomes_its_nexrl_lines(line: str) -> None:
    result = CliRunner().invoke(cli, ["convert-v1", "--launch", line])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == LAUNCH_GOLDEN[line]
    if "worker_process" in line:
        assert "NEXRL_WORKER_KEY" in result.stderr
        assert ("API_SERVER_URL" in result.stderr) == ("--api-server-url" not in line)


def test_several_launch_lines_print_in_order_each_note_once() -> None:
    lines = list(LAUNCH_GOLDEN)[2:4]
    result = CliRunner().invoke(cli, ["convert-v1", "--launch", lines[0], "--launch", lines[1]])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == LAUNCH_GOLDEN[lines[0]] + LAUNCH_GOLDEN[lines[1]]
    assert result.stderr.count("NEXRL_WORKER_KEY") == 1


@pytest.mark.parametrize("line", [line for line in LAUNCH_GOLDEN if "worker_process" in line])
def test_each_converted_worker_line_is_one_the_worker_takes(line: str) -> None:
    """The flags the converter carries are the worker's own (`nexrl_fsdp.worker.arguments`)."""
    from nexrl_fsdp.worker.arguments import parse_arguments

    (converted,) = LAUNCH_GOLDEN[line]
    args = shlex.split(converted)
    assert parse_arguments(args[args.index("nexrl_fsdp.worker") + 1 :], {"API_SERVER_URL": "10.0.0.1"}).identifier


@pytest.mark.parametrize(
    ("line", "problems"),
    [
        (
            "torchrun --nproc_per_node=2 -m nexrl.train_service_backend.distributed.worker_process --identifier g --dispatch-mode broadcast "
            "--backend megatron --offload 1",
            [
                "nexrl.train_service_backend.distributed.worker_process: unknown v1 flag --offload 1",
                "nexrl.train_service_backend.distributed.worker_process: --dispatch-mode broadcast is not supported: NexRL's ranks never get "
                "a whole batch each: rank 0 takes it from the driver and scatters its rows over the ranks (v1's own client refused "
                "broadcast groups too); use --dispatch-mode scatter",
                "nexrl.train_service_backend.distributed.worker_process: --backend megatron is not supported; NexRL's worker accepts fsdp",
            ],
        ),
        (
            "torchrun -m nexrl.train_service_backend.distributed.worker_process --backend fsdp",
            [
                "nexrl.train_service_backend.distributed.worker_process: give --identifier, the worker group's name (the recipe's backend.options.identifier)"
            ],
        ),
        (
            "python -m nexrl.main --config-name=a --multirun trainer.total_train_steps=3",
            [
                "nexrl.main: unknown v1 flag --multirun",
                "nexrl.main: Hydra override 'trainer.total_train_steps=3': write it into the v1 recipe before converting it (convert-v1 maps recipe keys)",
                "nexrl.main: give --config-path, the v1 recipe's folder",
            ],
        ),
        (
            "python -m nexrl.train_service_backend.api.api_server --host 0.0.0.0 --log-level info --port",
            [
                "nexrl.train_service_backend.api.api_server: unknown v1 flag --log-level info",
                "nexrl.train_service_backend.api.api_server: --port needs a value",
            ],
        ),
        (
            "torchrun -m train.py --x 1",
            ["torchrun runs no v1 worker (nexrl.train_service_backend.distributed.worker_process): this converts v1's worker lines only"],
        ),
        (
            "bash start.sh",
            [
                "not a v1 launch line: expected python -m nexrl.main ..., python -m nexrl.train_service_backend.api.api_server ... or torchrun ... -m nexrl.train_service_backend.distributed.worker_process ..."
            ],
        ),
    ],
)
def test_what_a_launch_line_cannot_carry_is_named_and_nothing_is_printed(line: str, problems: list[str]) -> None:
    result = CliRunner().invoke(cli, ["convert-v1", "--launch", list(LAUNCH_GOLDEN)[0], "--launch", line])
    assert result.exit_code == 2
    assert result.stdout == "", "not even the lines that converted: the launch is run whole or not at all"
    assert result.stderr.splitlines() == [f"nexrl convert-v1: {problem}" for problem in problems]


@pytest.mark.parametrize(
    ("line", "fix"),
    [
        (SEED_WORKER_LINE, "pip install 'nexrl[fsdp]' brings them"),
        (list(LAUNCH_GOLDEN)[-1], "pip install the NexRL extra named like v1's --backend (pip install 'nexrl[BACKEND]')"),
    ],
    ids=["with-backend", "without-backend"],
)
def test_without_a_plugin_that_runs_ranks_a_worker_line_says_what_to_install(monkeypatch: pytest.MonkeyPatch, line: str, fix: str) -> None:
    """The rank's module is the installed plugin's fact, never the core's guess: with none,
    a worker line is refused naming the extra of NexRL that v1's ``--backend`` names."""
    monkeypatch.setenv("NEXRL_DISABLE_PLUGINS", "fsdp")
    reset_registry()
    try:
        result = CliRunner().invoke(cli, ["convert-v1", "--launch", line])
    finally:
        reset_registry()
    assert result.exit_code == 2 and result.stdout == ""
    (problem,) = result.stderr.splitlines()
    assert problem.startswith(
        "nexrl convert-v1: nexrl.train_service_backend.distributed.worker_process: no installed plugin provides worker ranks "
        "(none registers nexrl_group_engines; disabled by NEXRL_DISABLE_PLUGINS: fsdp); "
    )
    assert fix in problem


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--launch", "bash x", str(SHAPES["design"])], "--launch converts command lines only; drop RECIPE"),
        (["--launch", "bash x", "-o", "x.yaml", "--agent", "m:f"], "drop -o, --agent"),
        ([], "give a v1 RECIPE to convert, or --launch LINE for a v1 command line"),
    ],
)
def test_launch_lines_and_recipes_are_converted_apart(args: list[str], message: str) -> None:
    result = CliRunner().invoke(cli, ["convert-v1", *args])
    assert result.exit_code == 2 and message in result.output
