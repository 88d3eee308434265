"""Every recipe key does something or is refused: a walk over the whole recipe schema.

The walk visits every leaf key a recipe can set: the core sections (`TrainConfig`) and
the options of every installed component a recipe picks by name (each backend, rollout
source, advantage estimator and policy loss, and each service holder's options under
``backend.options.holder``). Each key must have an entry in `KEYS`, which names, per
backend, the test that shows the key's effect there (a changed gradient, metric,
sample, file or error) or the test that shows the backend refusing it before step 1.
A key no backend reads differently (the schedule, the task, where the output goes) has
one entry for every backend (`EVERY_BACKEND`).

A new key with no entry fails `test_every_recipe_key_has_an_entry`, saying what to
add; a dummy key shows that it does (`test_a_key_without_an_entry_fails_the_walk`).

A name proves nothing by itself: `test_each_named_test_sets_its_key` checks, from what
the tests recorded while they ran (`nexrl_testing.recipe_key_records`), that every
test an entry names ran with that key set to a value other than its default, through a
recipe or the component's options object. Under ``make test`` it reads the records of
the whole run (it runs last); run alone, it runs the named tests itself first.
`test_an_entry_whose_test_never_sets_its_key_fails_the_walk` is its test.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import cache
from pathlib import Path

import attrs
import pytest

from nexrl_core.config.adamw import AdamWSettings
from nexrl_core.config.lora import LoraSettings
from nexrl_core.config.schema import REGISTRY_KIND, ModelConfig, TrainConfig
from nexrl_core.plugins.registry import get_registry
from nexrl_core.training.holders import HolderTarget, TrainStepConfig
from nexrl_testing.recipe_key_records import HOLDER_OPTIONS, KeyNaming, TestRecord, option_prefixes

ROOT = Path(__file__).resolve().parents[1]
EVERY_BACKEND = "*"
"""The key acts the same on every backend (the loop, the task or the trainer reads it)."""

COMPONENT_OPTIONS = {kind: prefix for kind, prefix in option_prefixes().items() if prefix != HOLDER_OPTIONS}
"""Registry kind of a component a recipe picks by name → where its options go."""

RecordsOf = Callable[[Iterable[str], Path], Mapping[str, "TestRecord | None"]]
"""The ``recipe_key_records`` fixture: what each named test set while it ran."""


@attrs.frozen
class Entry:
    """Where a key's effect, or its refusal, is shown, per backend."""

    effect: Mapping[str, tuple[str, ...]] = attrs.field(factory=dict)
    """Backend (or `EVERY_BACKEND`) → tests (``path::name``) that show the key changing
    what the run does there."""
    refused: Mapping[str, str] = attrs.field(factory=dict)
    """Backend → the test that shows the run refusing the key, by its path, before step 1."""


def everywhere(*tests: str) -> Entry:
    return Entry(effect={EVERY_BACKEND: tests})


def per_backend(refused: Mapping[str, str] | None = None, **effect: str | tuple[str, ...]) -> Entry:
    """``per_backend(inprocess="test", self_hosted=(...), refused={"remote_api": "test"})``."""
    shown = {name.replace("_hosted", "-hosted"): (tests,) if isinstance(tests, str) else tests for name, tests in effect.items()}
    return Entry(effect=shown, refused=dict(refused or {}))


# --- where each effect is shown ------------------------------------------------------------------

LOOP = "tests/test_train_loop.py"
SINKS = "plugins/nexrl_sinks/tests/test_quickstart_sinks.py"
WANDB_SINK = everywhere(f"{SINKS}::test_wandb_offline_run_holds_every_step_the_recipe_and_the_final_model")
MLFLOW_SINK = everywhere(f"{SINKS}::test_mlflow_run_holds_every_step_the_recipe_and_the_final_model")
TRACKIO_SINK = everywhere(
    "plugins/nexrl_sinks/tests/test_trackio_sink.py::"
    "test_trackio_holds_every_step_the_recipe_and_the_final_model_and_resume_continues_the_run"
)
SAMPLING = f"{LOOP}::test_sampling_settings_reach_every_sample"
RUN_FILES = f"{LOOP}::test_a_run_writes_metrics_curve_tensorboard_and_checkpoints"
BAD_INPUT = "tests/test_bad_input_table.py::test_bad_input_is_refused_cleanly"
DATA = "tests/test_data_formats.py"
LIMITS = "tests/test_rollout_limits.py"
PROMPT_LIMIT = (
    f"{LIMITS}::test_a_prompt_of_the_limit_passes_and_one_token_more_does_not",
    "plugins/nexrl_engine/tests/test_inprocess_backend.py::test_prompt_and_response_limits_hold_through_a_whole_run",
    "tests/test_e2e_train.py::test_prompt_and_response_limits_hold_on_the_embedded_service",
    "plugins/nexrl_episodes/tests/test_limits.py::test_a_prompt_of_the_limit_passes_and_one_token_more_does_not",
)
"""The prompt limit at its boundary in the core's runner, a whole in-process run, a whole
run on the embedded Tinker service, and the episode server (one implementation in the
core, `nexrl_core.run.limits`, for every backend and source)."""
INPROCESS = "plugins/nexrl_engine/tests/test_inprocess_backend.py"
INPROCESS_BAD_SETTINGS = f"{INPROCESS}::test_bad_settings_are_config_errors_naming_the_key"
SELF_HOSTED = "nexrl_fsdp/tests/test_selfhosted_backend.py"
SELF_HOSTED_OPTIONS = f"{SELF_HOSTED}::test_each_backend_option_reaches_its_part"
SELF_HOSTED_REFUSALS = f"{SELF_HOSTED}::test_options_the_workers_cannot_honour_are_refused_before_anything_starts"
WORKERS = "nexrl_fsdp/tests/test_workers.py"
RAY_RUNS = "plugins/nexrl_ray/tests/test_ray_self_hosted.py"
HOLDER_CONFIG = "plugins/nexrl_remote_api/tests/test_remote_backend.py::test_the_holder_config_takes_model_and_seed_from_the_recipe"
ADAMW = per_backend(
    remote_api=f"{LOOP}::test_train_step_config_carries_every_adam_parameter",
    inprocess="plugins/nexrl_engine/tests/test_inprocess_holder.py::test_every_adamw_field_reaches_the_optimizer",
    self_hosted=(
        "plugins/nexrl_grpo/tests/test_trainers.py::test_config_from_the_recipe",
        f"{WORKERS}::test_update_actor_gives_the_engines_loss_and_weights",
    ),
)
SCHEDULE_AND_CHECKPOINTING = (
    "plugins/nexrl_engine/tests/test_lr_schedule_and_checkpointing.py::test_recipe_schedule_and_checkpointing_reach_the_engine"
)
WORKERS_SCHEDULE_AND_CHECKPOINTING = "nexrl_fsdp/tests/test_workers_lr_schedule_and_checkpointing.py::test_the_workers_apply_each_steps_scheduled_rate_with_checkpointed_layers"
LR_SCHEDULE = per_backend(
    remote_api=f"{LOOP}::test_each_step_sends_its_scheduled_learning_rate_and_resume_sends_the_same",
    inprocess=SCHEDULE_AND_CHECKPOINTING,
    self_hosted=WORKERS_SCHEDULE_AND_CHECKPOINTING,
)
KL_REWARD = everywhere(
    "plugins/nexrl_grpo/tests/test_trainers.py::test_kl_in_the_reward_separates_runs_of_equal_outcome_by_their_kl",
    "tests/test_kl_end_to_end.py::test_kl_coefficient_keeps_the_policy_closer_to_the_reference",
    f"{SELF_HOSTED}::test_grpo_prepares_kl_in_reward_and_advantages_through_the_workers",
)
KL_ADAPTIVE = everywhere(
    "plugins/nexrl_grpo/tests/test_trainers.py::test_the_adaptive_controller_moves_the_coefficient_towards_the_target_and_resumes",
    f"{SELF_HOSTED}::test_grpo_prepares_kl_in_reward_and_advantages_through_the_workers",
)
TEACHER_REFUSED = "tests/test_teacher_recipe.py::test_a_teacher_is_refused_on_a_backend_that_cannot_hold_one"
SELF_HOSTED_TEACHER = (
    "nexrl_fsdp/tests/test_selfhosted_teacher.py::test_two_groups_on_one_workers_api_and_the_teachers_scores_are_the_advantage"
)
DISTILLATION = "plugins/nexrl_grpo/tests/test_distillation.py"
SELF_HOSTED_LORA = f"{SELF_HOSTED}::test_quickstart_fsdp_trains_lora_adapters_end_to_end"
LORA_TARGETS = per_backend(
    inprocess=(f"{INPROCESS}::test_lora_settings_reach_the_engine", "plugins/nexrl_engine/tests/test_lora.py::test_target_flags"),
    remote_api=(
        "nexrl_tinker/tests/test_holder_contract.py::TestTinkerHolder::test_lora_targets_reach_the_service",
        "nexrl_weaver/tests/test_holder_contract.py::TestWeaverHolder::test_lora_targets_reach_the_service",
    ),
    self_hosted=(SELF_HOSTED_LORA, f"{WORKERS}::test_only_the_attention_adapters_train"),
)
LORA_MLP_TARGET = attrs.evolve(
    LORA_TARGETS, effect={**LORA_TARGETS.effect, "self-hosted": (f"{WORKERS}::test_only_the_attention_adapters_train",)}
)
LORA_ATTN_TARGET = attrs.evolve(LORA_TARGETS, effect={**LORA_TARGETS.effect, "self-hosted": (SELF_HOSTED_LORA,)})
"""The quickstart_fsdp LoRA run turns attention off; the attention-only workers test, the MLP."""

CORE: dict[str, Entry] = {
    "task.name": everywhere("tests/test_e2e_train.py::test_shortened_quickstart_raises_validation_reward", BAD_INPUT),
    "task.data_path": everywhere(
        f"{LOOP}::test_jsonl_data_with_an_agent_module",
        f"{DATA}::test_one_training_step_gets_the_same_rewards_from_every_form",
        BAD_INPUT,
    ),
    "task.val_data_path": everywhere(
        f"{LOOP}::test_jsonl_data_with_an_agent_module", f"{DATA}::test_every_form_yields_the_same_items_in_the_same_order"
    ),
    "task.columns": everywhere(
        f"{DATA}::test_a_missing_column_is_refused_naming_the_file_and_the_column",
        f"{DATA}::test_the_held_out_file_is_checked_too",
    ),
    "task.agent": everywhere(f"{LOOP}::test_jsonl_data_with_an_agent_module", BAD_INPUT),
    "task.val_size": everywhere(SAMPLING),
    "backend.name": everywhere(f"{INPROCESS}::test_metrics_say_which_dtype_trained", BAD_INPUT),
    "model.name": everywhere(f"{SELF_HOSTED}::test_a_group_started_by_hand_is_driven_through_workers_url", BAD_INPUT),
    "model.lora.rank": per_backend(
        inprocess=f"{INPROCESS}::test_lora_settings_reach_the_engine",
        remote_api=(HOLDER_CONFIG, "nexrl_tinker/tests/test_holder_contract.py::TestTinkerHolder::test_lora_targets_reach_the_service"),
        self_hosted=(SELF_HOSTED_LORA, f"{WORKERS}::test_a_lora_update_on_two_ranks_equals_the_engines"),
    ),
    "model.lora.alpha": per_backend(
        refused={
            "remote_api": "nexrl_tinker/tests/test_holder_contract.py::TestTinkerHolder::test_lora_alpha_is_refused_where_the_api_has_none"
        },
        inprocess=f"{INPROCESS}::test_lora_settings_reach_the_engine",
        self_hosted=(SELF_HOSTED_LORA, f"{WORKERS}::test_a_lora_update_on_two_ranks_equals_the_engines"),
    ),
    "model.lora.train_mlp": LORA_MLP_TARGET,
    "model.lora.train_attn": LORA_ATTN_TARGET,
    "model.lora.train_unembed": LORA_TARGETS,
    "model.dtype": per_backend(
        remote_api=(
            "tests/test_e2e_train.py::test_bf16_trains_on_the_embedded_service",
            "nexrl_tinker/tests/test_holder_contract.py::TestTinkerHolder::test_model_dtype_must_be_what_the_service_trains_in",
        ),
        inprocess=(f"{INPROCESS}::test_metrics_say_which_dtype_trained", f"{INPROCESS}::test_recipe_settings_reach_the_engine"),
        self_hosted=f"{SELF_HOSTED}::test_a_group_started_by_hand_is_driven_through_workers_url",
    ),
    "model.gradient_checkpointing": per_backend(
        refused={
            "remote_api": "nexrl_tinker/tests/test_holder_contract.py::TestTinkerHolder::test_gradient_checkpointing_is_refused_before_step_1_by_name"
        },
        inprocess=SCHEDULE_AND_CHECKPOINTING,
        self_hosted=WORKERS_SCHEDULE_AND_CHECKPOINTING,
    ),
    "teacher.model": per_backend(
        refused={"remote_api": TEACHER_REFUSED},
        inprocess=(
            "plugins/nexrl_engine/tests/test_inprocess_teacher.py::test_the_teacher_scores_tokens_as_its_own_frozen_model",
            "plugins/nexrl_engine/tests/test_inprocess_teacher.py::test_a_distillation_step_trains_on_minus_coef_times_the_log_ratio_to_the_teacher",
        ),
        self_hosted=SELF_HOSTED_TEACHER,
    ),
    "model.mixed_precision": per_backend(
        refused={"remote_api": "tests/test_mixed_precision_refusals.py::test_the_remote_api_backend_refuses_it_before_step_1"},
        inprocess="plugins/nexrl_engine/tests/test_mixed_precision.py::test_the_recipe_key_reaches_the_inprocess_engine_and_sampling_uses_the_rounded_masters",
        self_hosted="nexrl_fsdp/tests/test_workers_mixed_precision.py::test_the_recipe_key_reaches_the_workers_through_the_backend",
    ),
    "algorithm.learning_rate": ADAMW,
    "algorithm.lr_schedule": LR_SCHEDULE,
    "algorithm.warmup_steps": LR_SCHEDULE,
    "algorithm.beta1": ADAMW,
    "algorithm.beta2": ADAMW,
    "algorithm.eps": ADAMW,
    "algorithm.weight_decay": ADAMW,
    "algorithm.grad_clip_norm": ADAMW,
    "algorithm.advantage.name": everywhere(
        "plugins/nexrl_grpo/tests/test_trainers.py::test_config_from_the_recipe",
        f"{LOOP}::test_per_token_advantages_train_through_the_trainer",
        f"{INPROCESS}::test_per_token_advantages_reach_the_engine",
    ),
    "algorithm.loss.name": per_backend(
        remote_api=(
            "tests/test_holder_backend.py::test_every_loss_option_travels_by_value",
            "nexrl_tinker/tests/test_holder_contract.py::TestTinkerHolderLossOptions",
        ),  # fmt: skip
        inprocess="plugins/nexrl_engine/tests/test_inprocess_holder.py::test_every_registered_loss_is_honoured",
        self_hosted=f"{WORKERS}::test_every_loss_option_reaches_the_workers_gradient",
    ),
    "algorithm.kl.coef": KL_REWARD,
    "algorithm.kl.controller": KL_ADAPTIVE,
    "algorithm.kl.target": KL_ADAPTIVE,
    "algorithm.kl.horizon": KL_ADAPTIVE,
    "algorithm.kl.penalty": everywhere("plugins/nexrl_grpo/tests/test_trainers.py::test_each_penalty_reaches_the_reward"),
    "rollout.source.name": everywhere(
        "plugins/nexrl_episodes/tests/test_train_e2e.py::test_the_episodes_quickstart_raises_held_out_reward"
    ),
    "rollout.prompts_per_step": everywhere(SAMPLING),
    "rollout.group_size": everywhere(SAMPLING),
    "rollout.max_tokens": everywhere(SAMPLING, BAD_INPUT),
    "rollout.max_prompt_tokens": everywhere(
        *PROMPT_LIMIT,
        f"{LIMITS}::test_the_error_is_one_line_naming_the_key_the_limit_the_length_and_the_item",
        "tests/test_e2e_train.py::test_an_over_long_prompt_stops_the_run_in_one_line_naming_the_key",
        BAD_INPUT,
    ),
    "rollout.prompt_overflow": everywhere(*PROMPT_LIMIT, f"{LIMITS}::test_an_agent_that_catches_the_refusal_cannot_hide_it", BAD_INPUT),
    "rollout.max_response_tokens": everywhere(
        f"{LIMITS}::test_a_multi_turn_agent_shares_one_budget_across_its_turns",
        f"{LIMITS}::test_a_truncated_turn_starts_a_trajectory_with_a_budget_of_its_own",
        "plugins/nexrl_engine/tests/test_inprocess_backend.py::test_prompt_and_response_limits_hold_through_a_whole_run",
        "tests/test_e2e_train.py::test_prompt_and_response_limits_hold_on_the_embedded_service",
        "plugins/nexrl_episodes/tests/test_limits.py::test_an_episodes_turns_share_one_response_budget",
    ),
    "rollout.temperature": everywhere(SAMPLING),
    "rollout.top_p": everywhere(SAMPLING),
    "rollout.concurrency": everywhere("tests/test_rollout.py::test_concurrency_is_bounded_and_results_keep_request_order", BAD_INPUT),
    "rollout.max_staleness": everywhere(
        f"{LOOP}::test_one_step_off_samples_step_k_with_the_weights_of_step_k_minus_2",
        "plugins/nexrl_episodes/tests/test_lifecycle.py::test_can_continue_is_false_past_the_allowed_staleness",
    ),
    "rollout.error_budget": everywhere(f"{LOOP}::test_agent_errors_beyond_the_budget_stop_the_run"),
    "rollout.max_agent_errors": everywhere(f"{LOOP}::test_total_error_budget"),
    "rollout.val_temperature": everywhere(SAMPLING),
    "schedule.steps": everywhere(RUN_FILES),
    "schedule.validate_every": everywhere(RUN_FILES),
    "schedule.checkpoint_every": everywhere(RUN_FILES),
    "output.dir": everywhere(RUN_FILES),
    "output.sinks": everywhere(
        f"{LOOP}::test_sinks_get_every_row_the_recipe_the_final_model_and_how_the_run_ended",
        f"{LOOP}::test_no_sinks_and_the_default_sinks",
        f"{SINKS}::test_wandb_offline_run_holds_every_step_the_recipe_and_the_final_model",
        f"{SINKS}::test_a_broken_sink_is_refused_before_step_1",
    ),
    "seed": everywhere(SAMPLING, f"{LOOP}::test_two_runs_of_one_recipe_agree"),
}

LOSS_OPTION_TESTS = per_backend(
    remote_api=(
        "nexrl_tinker/tests/test_holder_contract.py::TestTinkerHolderLossOptions",
        "nexrl_weaver/tests/test_holder_contract.py::TestWeaverHolderLossOptions",
    ),  # fmt: skip
    inprocess="plugins/nexrl_engine/tests/test_inprocess_holder.py::TestEngineHolderLossOptions",
    self_hosted=f"{WORKERS}::test_every_loss_option_reaches_the_workers_gradient",
)


def _loss_options() -> dict[str, Entry]:
    entries = {}
    for loss, options in {
        "ppo": ("clip_low", "clip_high", "dual_clip_c", "agg_mode", "norm_constant", "entropy_coeff"),
        "importance_sampling": ("agg_mode", "norm_constant", "entropy_coeff"),
        "cross_entropy": ("agg_mode", "norm_constant"),
        "cispo": ("clip_low", "clip_high", "agg_mode", "norm_constant", "entropy_coeff"),
        "gspo": ("clip_low", "clip_high", "agg_mode", "norm_constant", "entropy_coeff"),
        "dro": ("beta", "agg_mode", "norm_constant"),
    }.items():
        for option in options:
            entries[f"algorithm.loss.options.{option} [{loss}]"] = LOSS_OPTION_TESTS
    return entries


COMPONENTS: dict[str, Entry] = {
    **_loss_options(),
    # metrics sinks (output.sinks[].options)
    **{f"output.sinks.options.{key} [wandb]": WANDB_SINK for key in ("project", "entity", "run_name", "tags", "mode", "dir")},
    **{
        f"output.sinks.options.{key} [mlflow]": MLFLOW_SINK
        for key in ("tracking_uri", "experiment", "artifact_location", "run_name", "tags")
    },
    **{f"output.sinks.options.{key} [trackio]": TRACKIO_SINK for key in ("project", "run_name", "group")},
    "algorithm.advantage.options.norm_by_std [grpo]": everywhere(
        "plugins/nexrl_grpo/tests/test_advantages.py::test_grpo_without_std_normalisation_is_mean_centred"
    ),
    "algorithm.advantage.options.eps [grpo]": everywhere("plugins/nexrl_grpo/tests/test_advantages.py::test_grpo_eps_is_added_to_the_std"),
    "algorithm.advantage.options.gamma [reinforce_plus_plus]": everywhere(
        "plugins/nexrl_grpo/tests/test_advantages.py::test_reinforce_plus_plus_gamma_half"
    ),
    "algorithm.advantage.options.eps [reinforce_plus_plus]": everywhere(
        "plugins/nexrl_grpo/tests/test_advantages.py::test_reinforce_plus_plus_eps_is_added_to_the_std"
    ),
    "algorithm.advantage.options.kl_coef [on_policy_distillation]": everywhere(
        f"{DISTILLATION}::test_the_advantage_is_minus_coef_times_the_log_ratio_of_each_sampled_token",
        "plugins/nexrl_engine/tests/test_inprocess_teacher.py::test_a_distillation_step_trains_on_minus_coef_times_the_log_ratio_to_the_teacher",
    ),
    "algorithm.advantage.options.kl_discount [on_policy_distillation]": everywhere(
        f"{DISTILLATION}::test_kl_discount_adds_the_discounted_later_tokens"
    ),
    "algorithm.advantage.options.task_advantage [on_policy_distillation]": everywhere(
        f"{DISTILLATION}::test_the_task_advantage_is_added_to_the_distillation_term"
    ),
    "algorithm.advantage.options.scale [example.median]": everywhere(
        "examples/nexrl-example-plugin/tests/test_median_baseline.py::test_median_of_even_group_is_mean_of_middle_two"
    ),
    # backend: inprocess
    "backend.options.sample_linger_s [inprocess]": per_backend(inprocess=f"{INPROCESS}::test_recipe_settings_reach_the_engine"),
    "backend.options.sample_linger_max_s [inprocess]": per_backend(inprocess=f"{INPROCESS}::test_recipe_settings_reach_the_engine"),
    # What the engine does with these is tested on the engine itself (test_compute,
    # test_training, test_shared_prefix); these tests show the recipe's values reaching it.
    "backend.options.max_batch_rows [inprocess]": per_backend(inprocess=f"{INPROCESS}::test_recipe_settings_reach_the_engine"),
    "backend.options.device [inprocess]": per_backend(inprocess=INPROCESS_BAD_SETTINGS),  # CI has no other device than the default
    "backend.options.max_tokens_per_microbatch [inprocess]": per_backend(inprocess=f"{INPROCESS}::test_recipe_settings_reach_the_engine"),
    "backend.options.share_prefixes [inprocess]": per_backend(inprocess=f"{INPROCESS}::test_recipe_settings_reach_the_engine"),
    "backend.options.trainer [inprocess]": per_backend(inprocess=INPROCESS_BAD_SETTINGS),  # the one trainer that fits is the default
    # backend: remote_api
    "backend.options.service_holder [remote_api]": per_backend(remote_api=(RUN_FILES, BAD_INPUT)),
    "backend.options.base_url [remote_api]": per_backend(remote_api=(f"{LOOP}::test_api_key_env_is_the_key_the_holder_gets", BAD_INPUT)),
    "backend.options.api_key_env [remote_api]": per_backend(remote_api=f"{LOOP}::test_api_key_env_is_the_key_the_holder_gets"),
    "backend.options.service [remote_api]": per_backend(remote_api=(RUN_FILES, f"{LOOP}::test_bad_recipes_fail_with_the_key")),
    "backend.options.trainer [remote_api]": per_backend(remote_api=f"{LOOP}::test_bad_recipes_fail_with_the_key"),
    "backend.options.workers [remote_api]": per_backend(
        remote_api=(
            "tests/test_e2e_workers.py::test_the_embedded_service_trains_on_a_worker_group",
            "tests/test_e2e_workers.py::test_workers_with_a_service_url_is_refused_before_step_1",
        )
    ),
    "backend.options.device [remote_api]": per_backend(
        remote_api=(
            f"{LOOP}::test_the_embedded_service_runs_on_backend_options_device",
            "tests/test_embedded_service_device.py::test_a_device_this_machine_lacks_stops_the_run_before_step_1",
        )
    ),  # the GPU runs (tests/test_gpu_embedded_services.py) are skipped on CI, so they show nothing there
    "backend.options.max_tokens_per_microbatch [remote_api]": per_backend(
        remote_api=f"{LOOP}::test_the_embedded_service_packs_by_backend_options_max_tokens_per_microbatch"
    ),  # that the service's engines pack by it: nexrl_tinker/tests/test_service_microbatches.py
    "backend.options.holder [remote_api]": per_backend(remote_api=HOLDER_CONFIG),
    # backend: self-hosted
    **{
        f"backend.options.{key} [self-hosted]": per_backend(self_hosted=SELF_HOSTED_OPTIONS)
        for key in (
            "identifier",
            "update.ppo_epochs",
            "update.mini_batches",
            "update.micro_batch_rows",
            "update.max_tokens_per_microbatch",
            "recompute_old_logprobs",
            "sampler.sample_linger_s",
            "sampler.sample_linger_max_s",
            "sampler.max_batch_rows",
            "connect_timeout_s",
            "op_timeout_s",
        )  # fmt: skip
    },
    "backend.options.workers_url [self-hosted]": per_backend(
        self_hosted=f"{SELF_HOSTED}::test_a_group_started_by_hand_is_driven_through_workers_url"
    ),
    **{
        f"backend.options.{key} [self-hosted]": per_backend(
            self_hosted=f"{RAY_RUNS}::test_the_self_hosted_quickstart_on_ray_trains_like_on_this_machine"
        )
        for key in ("placement", "placement_options")
    },
    **{
        f"backend.options.{key} [remote_api]": per_backend(
            remote_api=f"{RAY_RUNS}::test_the_embedded_services_worker_group_is_placed_on_ray"
        )
        for key in ("placement", "placement_options")
    },
    "backend.options.teacher_world_size [self-hosted]": per_backend(self_hosted=SELF_HOSTED_TEACHER),
    "backend.options.world_size [self-hosted]": per_backend(
        self_hosted=f"{SELF_HOSTED}::test_the_sampler_gets_the_cores_the_local_ranks_and_the_driver_leave"
    ),
    "backend.options.trainer [self-hosted]": per_backend(self_hosted=SELF_HOSTED_REFUSALS),  # the one trainer that fits is the default
    "backend.options.sampler.device [self-hosted]": per_backend(self_hosted=SELF_HOSTED_REFUSALS),
    "backend.options.heartbeat_s [self-hosted]": per_backend(
        self_hosted="nexrl_fsdp/tests/test_workers_faults.py::test_a_rank_killed_during_update_actor_is_a_clear_error_and_nothing_hangs"
    ),
    "backend.options.max_restarts [self-hosted]": per_backend(
        self_hosted=(
            "tests/test_resume_real.py::test_any_killed_process_of_the_run_is_restarted_and_the_run_matches_an_uninterrupted_one",
            "tests/test_resume_real.py::test_with_no_restarts_left_a_lost_rank_stops_the_run_in_one_line",
        )
    ),
    "backend.options.dead_after_s [self-hosted]": per_backend(
        self_hosted=(
            SELF_HOSTED_OPTIONS,
            "nexrl_fsdp/tests/test_workers_faults.py::test_a_rank_killed_during_update_actor_is_a_clear_error_and_nothing_hangs",
        )
    ),
    # rollout source: episodes
    **{
        f"rollout.source.options.{key} [episodes]": everywhere(
            "plugins/nexrl_episodes/tests/test_source_options.py::test_server_options_shape_what_clients_get"
        )
        for key in ("host", "port", "public_url", "db_url", "api_key")
    },
    "rollout.source.options.claim_timeout_s [episodes]": everywhere(
        "plugins/nexrl_episodes/tests/test_lifecycle.py::test_a_silent_claim_goes_back_to_the_queue_and_its_late_end_is_refused"
    ),
    "rollout.source.options.max_attempts [episodes]": everywhere(
        "plugins/nexrl_episodes/tests/test_lifecycle.py::test_an_episode_that_keeps_failing_fails_its_run_instead_of_waiting_forever"
    ),
    **{
        f"rollout.source.options.local_workers.{key} [episodes]": everywhere(
            "plugins/nexrl_episodes/tests/test_train_e2e.py::test_the_episodes_quickstart_raises_held_out_reward", BAD_INPUT
        )
        for key in ("processes", "script", "concurrency")
    },
    # service holders' own options (backend.options.holder.*, remote_api only)
    "backend.options.holder.tokenizer_path [tinker]": per_backend(
        remote_api="nexrl_tinker/tests/test_holder_units.py::test_tokenizer_path_and_renderer_name_make_the_prompt"
    ),
    "backend.options.holder.renderer_name [tinker]": per_backend(
        remote_api="nexrl_tinker/tests/test_holder_units.py::test_tokenizer_path_and_renderer_name_make_the_prompt"
    ),
    "backend.options.holder.max_retries [tinker]": per_backend(
        remote_api="nexrl_tinker/tests/test_holder_units.py::test_transient_errors_are_retried_then_reported"
    ),
    "backend.options.holder.retry_backoff_s [tinker]": per_backend(
        remote_api="nexrl_tinker/tests/test_holder_units.py::test_transient_errors_are_retried_then_reported"
    ),
    "backend.options.holder.coalesce_window_s [tinker]": per_backend(
        remote_api="nexrl_tinker/tests/test_holder_contract.py::TestTinkerHolder::test_a_group_is_one_request_with_the_same_samples_as_alone"
    ),
    "backend.options.holder.tokenizer_path [weaver]": per_backend(
        remote_api="nexrl_weaver/tests/test_holder_units.py::test_tokenizer_path_is_read_without_the_service"
    ),
    "backend.options.holder.tensor_transport [weaver]": per_backend(
        remote_api="nexrl_weaver/tests/test_holder_transport.py::test_http_binary_answers_with_a_tensor_pack_and_the_same_step"
    ),
    "backend.options.holder.max_retries [weaver]": per_backend(
        remote_api="nexrl_weaver/tests/test_holder_units.py::test_transient_errors_are_retried_with_backoff_then_reported"
    ),
    "backend.options.holder.retry_backoff_s [weaver]": per_backend(
        remote_api="nexrl_weaver/tests/test_holder_units.py::test_transient_errors_are_retried_with_backoff_then_reported"
    ),
    "backend.options.holder.operation_timeout_s [weaver]": per_backend(
        remote_api="nexrl_weaver/tests/test_holder_units.py::test_an_operation_is_given_up_after_operation_timeout_s"
    ),
    "backend.options.holder.coalesce_window_s [weaver]": per_backend(
        remote_api="nexrl_weaver/tests/test_holder_contract.py::TestWeaverHolder::test_a_group_is_one_request_with_the_same_samples_as_alone"
    ),
}

KEYS: dict[str, Entry] = {**CORE, **COMPONENTS}
"""Every recipe key → where its effect or refusal is shown. Component options are
written ``<path> [<component name>]``."""


# --- the walk ---------------------------------------------------------------------------------------


def leaf_keys(config_class: type, prefix: str) -> Iterator[str]:
    """Dotted paths of the leaves of an attrs config class (nested attrs classes are walked)."""
    attrs.resolve_types(config_class)
    for field in attrs.fields(config_class):
        path = f"{prefix}.{field.name}" if prefix else field.name
        if isinstance(field.type, type) and attrs.has(field.type) and REGISTRY_KIND not in field.metadata:
            yield from leaf_keys(field.type, path)
        elif REGISTRY_KIND in field.metadata:
            yield f"{path}.name"  # its options are walked per registered component
        else:
            yield path


def installed_components() -> dict[str, dict[str, type]]:
    """Registry kind → component name → config class, for the kinds a recipe picks from,
    plus the service holders (whose options sit under ``backend.options.holder``)."""
    registry = get_registry()
    kinds = (*COMPONENT_OPTIONS, "service_holders")
    return {kind: {name: spec.config_class for name, spec in registry.specs[kind].items()} for kind in kinds}


def recipe_keys(root: type, components: Mapping[str, Mapping[str, type]]) -> list[str]:
    """Every key a recipe can set, component options as ``<path> [<name>]``."""
    keys = list(leaf_keys(root, ""))
    for kind, prefix in COMPONENT_OPTIONS.items():
        for name, config_class in components.get(kind, {}).items():
            if attrs.has(config_class):
                keys += [f"{key} [{name}]" for key in leaf_keys(config_class, prefix)]
    taken = {field.name for field in attrs.fields(HolderTarget)}
    for name, config_class in components.get("service_holders", {}).items():
        keys += [f"{HOLDER_OPTIONS}.{field.name} [{name}]" for field in attrs.fields(config_class) if field.name not in taken]
    return keys


def missing_entries(keys: list[str], table: Mapping[str, Entry]) -> list[str]:
    return [
        f"{key}: no entry; add one to KEYS in tests/test_recipe_keys.py naming the test that shows its effect on each "
        "backend that accepts it, or the test of its refusal on each backend that refuses it (or refuse it)"
        for key in keys
        if key not in table
    ]


@cache
def _defined_tests(path: str) -> frozenset[str]:
    tree = ast.parse((ROOT / path).read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
            names |= {f"{node.name}::{method}" for method in _methods(node, tree)}
    return frozenset(names)


def _methods(cls: ast.ClassDef, module: ast.Module) -> set[str]:
    """The methods of ``cls`` (defined in ``module``): its own, and those it inherits from
    classes defined there or imported from a module this environment can find (a shared
    contract, such as `nexrl_remote_api.testing`'s, defines a test once for two distributions)."""
    methods = {item.name for item in cls.body if isinstance(item, ast.FunctionDef)}
    for base in cls.bases:
        if isinstance(base, ast.Name) and (found := _class_named(base.id, module)) is not None:
            methods |= _methods(*found)
    return methods


def _class_named(name: str, module: ast.Module) -> tuple[ast.ClassDef, ast.Module] | None:
    """Where the class ``module`` knows as ``name`` is defined, and that module."""
    for node in module.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node, module
    for node in module.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                spec = importlib.util.find_spec(node.module) if (alias.asname or alias.name) == name else None
                if spec is not None and spec.origin is not None and spec.origin.endswith(".py"):
                    return _class_named(alias.name, ast.parse(Path(spec.origin).read_text()))
    return None


def _unknown_tests(entry: Entry) -> list[str]:
    unknown = []
    for test in named_tests(entry):
        path, _, name = test.partition("::")
        if not (ROOT / path).is_file() or name not in _defined_tests(path):
            unknown.append(test)
    return unknown


def named_tests(entry: Entry) -> list[str]:
    """Every test an entry names, for its effects and its refusals."""
    return [test for group in entry.effect.values() for test in group] + list(entry.refused.values())


def unproven(table: Mapping[str, Entry], records: Mapping[str, TestRecord | None]) -> list[str]:
    """Each (key, named test) where the records do not show the test setting the key."""
    problems = []
    for key, entry in table.items():
        for test in named_tests(entry):
            record = records.get(test)
            if record is None:
                problems.append(f"{key}: {test} never ran")
            elif record.skipped:
                problems.append(f"{key}: {test} was skipped here, so it shows nothing")
            elif key not in record.keys:
                problems.append(
                    f"{key}: {test} never sets it to a value other than its default; set it there through the "
                    "recipe or the component's options, or name a test that does"
                )
    return problems


# --- the tests --------------------------------------------------------------------------------------


def test_every_recipe_key_has_an_entry() -> None:
    keys = recipe_keys(TrainConfig, installed_components())
    assert len(keys) > 100, keys
    problems = missing_entries(keys, KEYS)
    assert not problems, "\n".join(problems)


def test_no_entry_names_a_key_that_does_not_exist() -> None:
    keys = set(recipe_keys(TrainConfig, installed_components()))
    assert sorted(set(KEYS) - keys) == []


@pytest.mark.parametrize("key", sorted(KEYS))
def test_each_entry_covers_every_backend_with_tests_that_exist(key: str) -> None:
    entry = KEYS[key]
    assert not _unknown_tests(entry), f"{key}: no such test {_unknown_tests(entry)}"
    if EVERY_BACKEND in entry.effect:
        return
    backends = set(get_registry().specs["backends"])
    covered = set(entry.effect) | set(entry.refused)
    component = key.partition(" [")[2].rstrip("]")
    if key.startswith("backend.options.") and component:
        backends = {"remote_api"} if key.startswith(HOLDER_OPTIONS) else {component}
    assert backends <= covered, f"{key}: no effect test or refusal for backend(s) {sorted(backends - covered)}"


def test_a_key_without_an_entry_fails_the_walk() -> None:
    """The test of the test: a dummy key in the core schema, or in a plugin's config
    class, is reported with what to add."""
    core = attrs.make_class("WithDummy", {"dummy_key": attrs.field(default=0)}, bases=(TrainConfig,), frozen=True, kw_only=True)
    components = installed_components()
    assert missing_entries(recipe_keys(core, components), KEYS) == [
        "dummy_key: no entry; add one to KEYS in tests/test_recipe_keys.py naming the test that shows its effect on each "
        "backend that accepts it, or the test of its refusal on each backend that refuses it (or refuse it)"
    ]
    ppo = components["policy_losses"]["ppo"]
    extended = attrs.make_class("PpoWithDummy", {"dummy_option": attrs.field(default=0)}, bases=(ppo,), frozen=True, kw_only=True)
    patched = {**components, "policy_losses": {**components["policy_losses"], "ppo": extended}}
    problems = missing_entries(recipe_keys(TrainConfig, patched), KEYS)
    assert [problem.split(":")[0] for problem in problems] == ["algorithm.loss.options.dummy_option [ppo]"]


def test_an_entry_naming_a_missing_test_is_caught() -> None:
    assert _unknown_tests(everywhere("tests/test_recipe_keys.py::test_that_was_never_written")) == [
        "tests/test_recipe_keys.py::test_that_was_never_written"
    ]


def test_a_test_a_class_inherits_is_defined_there() -> None:
    """A shared contract's test counts as defined in each class that inherits it, through
    every level (the SDK holders' contract, and the core's kit it builds on)."""
    tests = _defined_tests("nexrl_tinker/tests/test_holder_contract.py")
    assert "TestTinkerHolder::test_lora_targets_reach_the_service" in tests
    assert "TestTinkerHolder::test_chat_template_renders_text_and_token_ids" in tests
    assert "TestTinkerHolder::test_that_was_never_written" not in tests


@pytest.mark.slow
def test_each_named_test_sets_its_key(recipe_key_records: RecordsOf) -> None:
    records = recipe_key_records({test for entry in KEYS.values() for test in named_tests(entry)}, ROOT)
    problems = unproven(KEYS, records)
    assert not problems, "\n".join(problems)


def test_what_counts_as_setting_a_key() -> None:
    """A value equal to the default sets nothing; recipe data counts before it is checked;
    a component's options name the component's choice; the step a holder gets and a
    holder's target carry the recipe's algorithm and model."""
    naming = KeyNaming(get_registry())
    registry = get_registry()
    grpo, ppo = (registry.specs[kind][name].config_class for kind, name in (("advantage_estimators", "grpo"), ("policy_losses", "ppo")))
    recipe = {"rollout": {"top_p": 1.0, "group_size": 4}, "algorithm": {"beta2": 1.0, "loss": {"name": "ppo"}}}
    assert sorted(naming.structured(recipe, TrainConfig)) == ["algorithm.beta2", "algorithm.loss.name", "rollout.group_size"]
    assert naming.built(grpo(eps=0.5)) == ["algorithm.advantage.options.eps [grpo]"]
    assert naming.built(ppo(clip_low=0.2, clip_high=0.3)) == ["algorithm.loss.name", "algorithm.loss.options.clip_high [ppo]"]
    step = TrainStepConfig(loss_fn="ppo", loss_fn_config={"clip_low": 0.2, "clip_high": 0.3}, optimizer=AdamWSettings(beta1=0.8))
    assert sorted(naming.built(step)) == ["algorithm.beta1", "algorithm.loss.name", "algorithm.loss.options.clip_high [ppo]"]
    holder = registry.specs["service_holders"]["tinker"].config_class
    built = naming.built(holder(model=ModelConfig(name="m", lora=LoraSettings(rank=4)), seed=3, base_url="http://x", max_retries=1))
    assert sorted(built) == ["backend.options.holder.max_retries [tinker]", "model.lora.rank", "model.name", "seed"]


GRPO_EPS_TEST = "plugins/nexrl_grpo/tests/test_advantages.py::test_grpo_eps_is_added_to_the_std"
"""Sets ``eps`` of the ``grpo`` estimator, and no other key."""


def test_an_entry_whose_test_never_sets_its_key_fails_the_walk(recipe_key_records: RecordsOf) -> None:
    """The test of the test: an entry naming a real test that leaves its key at the
    default is reported; the key that test does set is not."""
    table = {
        "algorithm.advantage.options.eps [grpo]": everywhere(GRPO_EPS_TEST),
        "algorithm.advantage.options.norm_by_std [grpo]": everywhere(GRPO_EPS_TEST),
    }
    assert unproven(table, recipe_key_records([GRPO_EPS_TEST], ROOT)) == [
        f"algorithm.advantage.options.norm_by_std [grpo]: {GRPO_EPS_TEST} never sets it to a value other than its "
        "default; set it there through the recipe or the component's options, or name a test that does"
    ]


def describe(key: str) -> str:
    """One line of the closing list: the key and where its effect or refusal is shown."""
    entry = KEYS[key]
    parts = [f"effect on {backend if backend != EVERY_BACKEND else 'every backend'}" for backend in sorted(entry.effect)]
    parts += [f"refused on {backend}" for backend in sorted(entry.refused)]
    return f"{key}: {', '.join(parts)}"


if __name__ == "__main__":  # `python tests/test_recipe_keys.py` prints the list
    for key in KEYS:
        print(describe(key))
