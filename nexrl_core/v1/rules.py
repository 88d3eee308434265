"""The conversions of `nexrl_core.v1.keys.yaml` that read several v1 keys at once.

Each rule is named in the table (``rule:``) and may write only the NexRL keys the table
lists for the key it writes them for (`Converter.carry` refuses others), so what the page
``docs/coming-from-v1.md`` says a key becomes is what the converter does with it. A rule
reports every key of its rows the recipe sets: carried, dropped or not supported; where
v1 trained otherwise than the recipe says, it writes the recipe's meaning and asks the
user to choose (`Converter.ask`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nexrl_core.config.env_refs import env_refs, is_single_ref
from nexrl_core.v1.convert import TRAIN_SERVICE, Converter, show
from nexrl_core.v1.distillation import distillation, names_a_teacher, opd_trainer
from nexrl_core.v1.reading import number, ranks
from nexrl_core.v1.table import ABSENT

__all__ = ["RULES"]

ACTOR = "train_service.actor."


def run_dir(converter: Converter) -> None:
    """The run's folder under runs/, named as v1 named the experiment."""
    name = converter.value("experiment_name")
    if name is not ABSENT:
        converter.carry("experiment_name", {"output.dir": f"runs/{name}"}, note="v1 wrote under $EXPERIMENT_PATH")


def backend(converter: Converter) -> None:
    """The train service's backend picks the NexRL backend; the trainer keeps its name."""
    profile = converter.profile
    settings = profile.backend
    options = dict(settings.get("options", {}))
    trainer = options.pop("trainer")
    assignments: dict[str, Any] = {"backend.name": settings["name"]}
    assignments.update({f"backend.options.{key}": value for key, value in options.items()})
    converter.carry("train_service.backend", assignments, note=f"v1 trained on {profile.about}")
    v1_trainer = converter.value("trainer.type")
    if v1_trainer is ABSENT or v1_trainer == trainer:
        converter.carry("trainer.type", {"backend.options.trainer": trainer})
    elif opd_trainer(converter) and names_a_teacher(converter):
        converter.carry(
            "trainer.type",
            {"backend.options.trainer": trainer},
            note=f"v1's {v1_trainer} is {trainer} with teacher.model and the on_policy_distillation estimator",
        )
    elif opd_trainer(converter):
        converter.refuse(
            "trainer.type",
            f"v1's {v1_trainer} trainer distils from a teacher, and the recipe names none (trainer.teachers, or a train service "
            "of role teacher)",
            f"name the teacher, or train with {trainer}",
        )
    else:
        converter.refuse(
            "trainer.type",
            f"v1's {v1_trainer} trainer has no NexRL counterpart on {profile.about} (NexRL's is {trainer})",
            f"use {trainer}, or register a trainer of your own with the nexrl_trainers hook (docs/plugins.md)",
        )
    if profile.kind != "service" or profile.holder_section is None:
        return
    key = f"{profile.holder_section}.base_url"
    url = converter.value(key)
    if url is ABSENT or url is None or url == "":
        converter.carry(key, {"backend.options.base_url": profile.hosted_url}, note="v1 left it to its SDK, which used the hosted service")
    else:
        converter.carry(key, {"backend.options.base_url": url})


def api_key(converter: Converter) -> None:
    """A key held in the environment is named by its variable; a key written in the recipe is never copied."""
    profile = converter.profile
    if profile.kind != "service" or profile.holder_section is None:
        return
    key = f"{profile.holder_section}.api_key"
    value = converter.value(key)
    variable = {"backend.options.api_key_env": profile.api_key_env}
    if value is ABSENT or value is None or value == "":
        converter.carry(key, variable, note=f"v1's SDK read {profile.api_key_env}")
        return
    text = str(value)
    refs = env_refs(text)
    if refs and is_single_ref(text):
        converter.carry(key, {"backend.options.api_key_env": refs[0].name}, note="the variable's name, never its value")
        if refs[0].default:
            converter.also_drop(key, "the default after the comma is a key written in the recipe; never copied")
        return
    converter.carry(key, variable)
    converter.also_drop(
        key,
        f"a key written in the recipe is never copied; export it as {profile.api_key_env} (backend.options.api_key_env names the variable)",
    )


def lora(converter: Converter) -> None:
    """v1's Weaver-style ``training_mode`` full fine-tuning is rank 0; otherwise its ``lora_rank``."""
    sections = [row.v1.rsplit(".", 1)[0] for row in converter.table.rules if row.v1.endswith(".training_mode")]
    for section in sections:
        mode_key, rank_key = f"{section}.training_mode", f"{section}.lora_rank"
        if not converter.applies(converter.row(mode_key)):
            continue
        mode, rank = converter.value(mode_key), converter.value(rank_key)
        if mode in ("full_ft", "full"):
            converter.carry(mode_key, {"model.lora.rank": 0}, note="every weight trains")
            converter.drop(rank_key, "ignored with training_mode full_ft")
        elif mode == "lora":
            converter.carry(rank_key, {"model.lora.rank": rank})
            converter.drop(mode_key, "LoRA adapters of lora_rank, as model.lora.rank says")
        else:
            converter.refuse(
                mode_key,
                f"training mode {mode!r} is not one v1 knew (lora, full_ft)",
                "set model.lora.rank: 0 for full fine-tuning, > 0 for LoRA",
            )
            converter.drop(rank_key, "read with a training mode NexRL does not know")


def world_size(converter: Converter) -> None:
    """The student's ranks."""
    ranks(converter, TRAIN_SERVICE, "backend.options.world_size")


def op_timeout(converter: Converter) -> None:
    """v1's wait for one worker result, in milliseconds, is NexRL's bound on one operation, in seconds."""
    value = converter.value("train_service.config.zmq_recv_timeout_ms")
    if value is ABSENT:
        return
    milliseconds = number(converter, "train_service.config.zmq_recv_timeout_ms", value)
    if milliseconds is not None:
        converter.carry("train_service.config.zmq_recv_timeout_ms", {"backend.options.op_timeout_s": milliseconds / 1000})


def model_path(converter: Converter) -> None:
    """The workers' model: ``actor.model.path``, else the inference service's ``model_path``,
    else the design documents' ``trainer.algorithm.inference_service.model``."""
    if converter.kind != "workers":
        return
    keys = ("train_service.actor.model.path", "service.inference_service.model_path", "trainer.algorithm.inference_service.model")
    present = [key for key in keys if converter.present(key)]
    if not present:
        return
    first, *rest = present
    chosen = converter.value(first)
    converter.carry(first, {"model.name": chosen})
    for key in rest:
        same = converter.value(key) == chosen
        converter.drop(key, f"v1's workers loaded {converter.name(first)}" + ("" if same else f" ({show(chosen)}), not this"))


_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}


def _data_path(converter: Converter, v1: str, new: str, files: Any) -> None:
    listed = [files] if isinstance(files, str) else list(files) if isinstance(files, list) else None
    if not listed or not all(isinstance(file, str) for file in listed):
        converter.refuse(v1, f"expected a file or a list of files, got {files!r}", f"set {new} yourself")
        return
    if len(listed) == 1:
        converter.carry(v1, {new: listed[0]})
        return
    builders = {_BUILDERS.get(Path(file).suffix.lower()) for file in listed}
    if len(builders) != 1 or None in builders:
        converter.refuse(
            v1,
            "files of several formats (or one NexRL does not read) in one list",
            f"convert them to one format (parquet, jsonl or csv) and set {new}",
        )
        return
    converter.carry(v1, {new: {"builder": builders.pop(), "data_files": listed}}, note="read with Hugging Face datasets' load_dataset")


def data_files(converter: Converter) -> None:
    files = converter.value("data.data_files")
    if files is not ABSENT:
        _data_path(converter, "data.data_files", "task.data_path", files)
    kind = converter.value("validate.data.type")
    held_out = converter.value("validate.data.data_files")
    if kind == "mock":
        converter.drop("validate.data.type", "v1 validated on synthetic mock items, not on files")
        converter.drop("validate.data.data_files", "unread: validate.data.type is mock")
        return
    if kind not in (ABSENT, "torch"):
        converter.refuse("validate.data.type", f"v1 validation data of type {kind!r}", "set task.val_data_path to held-out files")
        converter.drop("validate.data.data_files", f"read by a validation loader of type {kind!r}")
        return
    converter.drop("validate.data.type", "NexRL reads the files in task.val_data_path itself")
    if held_out is not ABSENT:
        _data_path(converter, "validate.data.data_files", "task.val_data_path", held_out)


def prompt_key(converter: Converter) -> None:
    column = converter.value("data.prompt_key")
    if column is not ABSENT:
        converter.carry("data.prompt_key", {"task.columns": [column]}, note="checked in every data file before the run starts")


def prompt_limit(converter: Converter) -> None:
    """Prompts over the limit were left out by v1 (its loader with ``filter_prompts``, its
    math agent by ``rollout_worker.max_prompt_length``); NexRL skips such a run."""
    filtering = converter.value("data.filter_prompts") is True
    sources: list[tuple[str, Any]] = []
    if filtering and converter.present("data.max_prompt_length"):
        sources.append(("data.max_prompt_length", converter.value("data.max_prompt_length")))
    else:
        converter.drop("data.max_prompt_length", "read only with data.filter_prompts true")
    if converter.present("rollout_worker.max_prompt_length"):
        sources.append(("rollout_worker.max_prompt_length", converter.value("rollout_worker.max_prompt_length")))
    numbers = [(key, found) for key, value in sources if (found := number(converter, key, value)) is not None]
    if not numbers:
        converter.drop("data.filter_prompts", "no prompt limit to filter by" if filtering else "false: v1's loader kept long prompts")
        return
    limit = int(min(value for _, value in numbers))
    assignments = {"rollout.max_prompt_tokens": limit, "rollout.prompt_overflow": "skip"}
    for key, _ in numbers:
        converter.carry(key, assignments, note="a longer prompt's run is skipped, as v1 left such prompts out")
    if filtering:
        converter.carry("data.filter_prompts", assignments)
    else:
        converter.drop("data.filter_prompts", "false: v1's loader kept long prompts")


def sequence_limit(converter: Converter) -> None:
    key = "rollout_worker.max_sequence_length"
    if not converter.present(key):
        return
    limit = number(converter, key, converter.value(key))
    if limit is None:
        return
    prompt, reply = converter.output("rollout.max_prompt_tokens"), converter.output("rollout.max_tokens")
    if isinstance(prompt, int) and isinstance(reply, int) and limit >= prompt + reply:
        converter.drop(
            key, f"at least the prompt limit ({prompt}) and the reply limit ({reply}) together, so it cut no single-turn trajectory"
        )
        return
    converter.refuse(
        key,
        "v1 cut each trajectory at this many tokens, prompt and replies together, and zeroed its reward",
        "bound the prompt with rollout.max_prompt_tokens and the generated tokens with rollout.max_response_tokens",
    )


AGENT_KEYS = (
    "rollout_worker.type",
    "rollout_worker.agent_cls",
    "rollout_worker.custom_rollout_worker_module_path",
    "rollout_worker.custom_rollout_worker_class_name",
)


def agent(converter: Converter) -> None:
    """v1's rollout worker runs no code NexRL has: ``--agent`` names the NexRL agent that
    replaces it, else each way v1 named one is a not-supported line saying where to port it."""
    present = [key for key in AGENT_KEYS if converter.present(key)]
    if converter.agent is not None:
        for key in present or ["rollout_worker.type"]:
            converter.carry(key, {"task.agent": converter.agent}, note="--agent replaces v1's rollout worker")
        return
    module = converter.value("rollout_worker.custom_rollout_worker_module_path")
    if module is not ABSENT:
        file = Path(str(module))
        file = file if file.is_absolute() else converter.recipe_path.parent / file
        name = converter.value("rollout_worker.custom_rollout_worker_class_name")
        name = "CustomRolloutWorker" if name is ABSENT else name
        converter.refuse(
            "rollout_worker.custom_rollout_worker_module_path",
            f"v1 rollout worker {name} in {file}",
            "port its rollout(task) to an agent function that takes (item, llm) and returns the reward, then pass "
            "--agent module:function (task.agent); a worker that drives its own loop becomes a rollout source "
            "registered with the nexrl_rollout_sources hook (docs/plugins.md)",
        )
        converter.drop("rollout_worker.custom_rollout_worker_class_name", "named with custom_rollout_worker_module_path")
        converter.drop("rollout_worker.type", "the worker custom_rollout_worker_module_path loads")
        converter.drop("rollout_worker.agent_cls", "unread: the custom worker runs instead")
        return
    kind = converter.value("rollout_worker.type")
    if kind in (ABSENT, "agent"):
        builtin = converter.value("rollout_worker.agent_cls")
        builtin = "single_turn_math" if builtin is ABSENT else builtin
        converter.refuse(
            "rollout_worker.agent_cls",
            f"v1's built-in agent {builtin}",
            "write it as an agent function (examples/math/math_agent.py does single_turn_math's job: copy it beside the "
            "recipe) and pass --agent math_agent:solve (task.agent)",
        )
        if not converter.present("rollout_worker.agent_cls"):
            converter.refuse(
                "rollout_worker.type", f"v1's agent worker running its built-in {builtin}", "pass --agent module:function (task.agent)"
            )
        else:
            converter.drop("rollout_worker.type", "the worker that ran agent_cls")
        return
    converter.refuse(
        "rollout_worker.type",
        f"v1's built-in {kind} rollout worker",
        "write it as an agent function and pass --agent module:function (task.agent)",
    )
    converter.drop("rollout_worker.agent_cls", f"unread by the {kind} worker")


def staleness(converter: Converter) -> None:
    mode = converter.value("weight.sync_mode")
    if mode is ABSENT:
        converter.drop("weight.staleness_threshold", "read only with weight.sync_mode batch-async")
        return
    if mode == "sync":
        converter.carry("weight.sync_mode", {"rollout.max_staleness": 0}, note="every step samples with the latest weights")
        converter.drop("weight.staleness_threshold", "read only with weight.sync_mode batch-async")
    elif mode == "batch-async":
        threshold = converter.value("weight.staleness_threshold")
        threshold = 0 if threshold is ABSENT else threshold
        converter.carry("weight.staleness_threshold", {"rollout.max_staleness": threshold})
        converter.drop("weight.sync_mode", "batch-async: the staleness bound is weight.staleness_threshold")
    else:
        converter.refuse(
            "weight.sync_mode",
            f"{mode}: v1 never synced weights to the sampler in this mode (by reading: it never entered a sync)",
            "choose how stale rollouts may be with rollout.max_staleness",
        )
        converter.drop("weight.staleness_threshold", "read only with weight.sync_mode batch-async")


_DTYPES = {"fp32": "fp32", "float32": "fp32", "32": "fp32", "bf16": "bf16", "bfloat16": "bf16"}


def precision(converter: Converter) -> None:
    """v1's workers loaded fp32 weights and computed in bf16 by default: ``dtype: bf16`` with
    ``mixed_precision: true`` (fp32 masters) here."""
    if converter.kind != "workers":
        return
    keys = [
        f"{ACTOR}fsdp_config.model_dtype",
        f"{ACTOR}fsdp_config.mixed_precision.param_dtype",
        f"{ACTOR}fsdp_config.mixed_precision.reduce_dtype",
    ]
    names = [_DTYPES.get(str(converter.value(key))) for key in keys]
    for key, name in zip(keys, names):
        if name is None:
            converter.refuse(
                key,
                f"dtype {converter.value(key)!r}",
                "NexRL trains in fp32 or bf16 (model.dtype), with fp32 masters under bf16 compute (model.mixed_precision)",
            )
    if None in names:
        return
    weights, compute, reduce = names
    if reduce != "fp32":
        converter.refuse(keys[2], "gradients reduced in bf16", "NexRL reduces them in fp32; leave reduce_dtype at fp32")
        return
    if weights == "bf16" and compute == "fp32":
        converter.refuse(keys[1], "bf16 weights computed in fp32", "choose model.dtype fp32, or bf16 weights computed in bf16")
        return
    assignments = {
        "model.dtype": compute if weights == "fp32" else "bf16",
        "model.mixed_precision": weights == "fp32" and compute == "bf16",
    }
    present = [key for key in keys if converter.present(key)]
    for key in present or keys[:1]:
        converter.carry(key, assignments, note="fp32 masters under bf16 compute" if assignments["model.mixed_precision"] else "")


def old_logprobs(converter: Converter) -> None:
    if converter.kind != "workers":
        return
    trainer_key, actor_key = "trainer.algorithm.do_old_log_prob_compute", f"{ACTOR}do_old_log_prob_compute"
    recompute, use = converter.value(trainer_key), converter.value(actor_key)
    use = recompute if use is ABSENT else use
    if use is False:
        converter.refuse(
            actor_key,
            "v1 then took the importance ratio as 1 (old log-probs were the current ones, detached), so it never clipped",
            "NexRL compares with log-probs recomputed before the update (backend.options.recompute_old_logprobs: true) or "
            "with the sampler's (false); choose one",
        )
        converter.drop(trainer_key, "unread by the loss while train_service.actor.do_old_log_prob_compute is false")
    elif recompute is False:
        converter.refuse(
            trainer_key,
            "v1's workers then compared the policy with all-zero old log-probs",
            "set backend.options.recompute_old_logprobs: true",
        )
        converter.drop(actor_key, "it compared with the zeros trainer.algorithm.do_old_log_prob_compute false left")
    else:
        for key in [key for key in (trainer_key, actor_key) if converter.present(key)] or [trainer_key]:
            converter.carry(key, {"backend.options.recompute_old_logprobs": True})


_PENALTIES = {"kl", "abs", "mse", "low_var_kl"}
_KL_FIELDS = ("type", "kl_coef", "kl_reward_coef", "target_kl", "horizon")


def kl(converter: Converter) -> None:
    """KL in the reward: what the recipe meant, and a line on what v1 did instead."""
    use_key, penalty_key = "trainer.algorithm.use_kl_in_reward", "trainer.algorithm.kl_penalty"
    read, misplaced = "trainer.algorithm.critic.kl_ctrl", "trainer.algorithm.kl_ctrl"
    keys = [f"{section}.{field}" for section in (read, misplaced) for field in _KL_FIELDS]
    if converter.value(use_key) is not True:
        converter.carry(use_key, {"algorithm.kl.coef": 0.0}, note="no KL in the reward")
        for key in [penalty_key, *keys]:
            converter.drop(key, "read only with trainer.algorithm.use_kl_in_reward true")
        return
    in_read = any(converter.present(f"{read}.{field}") for field in _KL_FIELDS)
    source = read if in_read or not any(converter.present(f"{misplaced}.{field}") for field in _KL_FIELDS) else misplaced
    if source == read:
        for kl_field in _KL_FIELDS:
            converter.drop(f"{misplaced}.{kl_field}", "v1 read trainer.algorithm.critic.kl_ctrl instead")

    def field(name: str) -> Any:
        value = converter.value(f"{source}.{name}") if converter.present(f"{source}.{name}") else ABSENT
        return converter.value(f"{read}.{name}") if value is ABSENT and source == read else value

    controller = field("type")
    controller = ("adaptive" if source == read else "fixed") if controller is ABSENT else controller
    coef_key = f"{source}.kl_reward_coef" if field("kl_reward_coef") is not ABSENT else f"{source}.kl_coef"
    coef = field("kl_reward_coef") if field("kl_reward_coef") is not ABSENT else field("kl_coef")
    if coef is ABSENT or coef == 0:
        converter.carry(use_key, {"algorithm.kl.coef": 0.0}, note="a coefficient of 0: no KL in the reward")
        for key in [penalty_key, *keys]:
            converter.drop(key, "unread with a KL coefficient of 0")
        return
    if coef_key.endswith("kl_reward_coef"):
        converter.drop(f"{source}.kl_coef", "kl_reward_coef is the coefficient v1's reward used")
    penalty = converter.value(penalty_key)
    if controller not in ("fixed", "adaptive") or penalty not in _PENALTIES:
        bad, what = (f"{source}.type", controller) if controller not in ("fixed", "adaptive") else (penalty_key, penalty)
        converter.refuse(
            bad,
            f"{what!r} has no NexRL counterpart",
            "choose algorithm.kl.controller (fixed, adaptive) and algorithm.kl.penalty (kl, abs, mse, low_var_kl)",
        )
        return
    converter.carry(use_key, {"algorithm.kl.coef": coef})
    converter.carry(coef_key, {"algorithm.kl.coef": coef})
    converter.carry(penalty_key, {"algorithm.kl.penalty": penalty})
    converter.carry(f"{source}.type", {"algorithm.kl.controller": controller})
    if controller == "adaptive":
        converter.carry(f"{source}.target_kl", {"algorithm.kl.target": field("target_kl") if field("target_kl") is not ABSENT else 6.0})
        converter.carry(f"{source}.horizon", {"algorithm.kl.horizon": field("horizon") if field("horizon") is not ABSENT else 10000})
    else:
        for name in ("target_kl", "horizon"):
            converter.drop(f"{source}.{name}", "read only by the adaptive controller")
    if converter.kind == "service":
        why = f"v1's trainer for {converter.profile.about} applied no KL at all"
    elif source == misplaced:
        why = "v1 read kl_ctrl only under trainer.algorithm.critic (so not these values), and its workers computed no reference log-probs"
    else:
        why = "v1's workers computed no reference log-probs"
    converter.ask(
        use_key,
        f"{why}: its KL term was zero in practice; written: the KL the recipe meant (algorithm.kl.coef = {show(coef)}); set algorithm.kl.coef: 0 to train as v1 did",
    )


_WORKER_LOSSES = {"NX_20250515": "ppo", "NX_20241031": "ppo", "importance_sampling": "importance_sampling"}
_SERVICE_LOSSES = {"importance_sampling", "ppo", "cispo", "cross_entropy"}
_AGG_MODES = {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum"}


def _entropy(converter: Converter, key: str, loss: str) -> None:
    if loss == "cross_entropy":
        converter.drop(key, "cross_entropy has no entropy bonus")
        return
    unsent = converter.profile.unsent
    if key in unsent:
        used = unsent[key]
        if converter.present(key):
            value = converter.value(key)
            converter.carry(key, {"algorithm.loss.options.entropy_coeff": value})
            if value != used:
                converter.ask(
                    key,
                    f"v1 never sent this to {converter.profile.about}, which trained with {show(used)}; written: the recipe's {show(value)}; set algorithm.loss.options.entropy_coeff: {show(used)} to train as v1 did",
                )
        else:
            converter.carry(
                key, {"algorithm.loss.options.entropy_coeff": used}, note=f"what {converter.profile.about} used: v1 never sent it"
            )
        return
    value = converter.value(key)
    if value is not ABSENT:
        converter.carry(key, {"algorithm.loss.options.entropy_coeff": value})


def loss(converter: Converter) -> None:
    if converter.kind == "service":
        key = "train_service.config.loss_fn"
        name = converter.value(key)
        if name not in _SERVICE_LOSSES:
            converter.refuse(
                key, f"loss {name!r} has no NexRL counterpart", f"choose algorithm.loss.name ({', '.join(sorted(_SERVICE_LOSSES))})"
            )
            converter.drop("train_service.config.entropy_coeff", "read with a loss NexRL does not have")
            return
        converter.carry(
            key,
            {"algorithm.loss.name": name, "algorithm.loss.options.agg_mode": converter.profile.agg_mode},
            note="the service sums the loss over tokens",
        )
        _entropy(converter, "train_service.config.entropy_coeff", name)
        return
    keys = {
        name: f"{ACTOR}{name}"
        for name in ("loss_func_type", "clip_ratio", "clip_ratio_low", "clip_ratio_high", "loss_agg_mode", "entropy_coeff")
    }
    kind = converter.value(keys["loss_func_type"])
    if kind is ABSENT:
        return
    if kind not in _WORKER_LOSSES:
        instead = (
            "its formula is ppo with dual_clip_c" if kind == "NX_20250515_v2" else "choose algorithm.loss.name (nexrl plugins lists them)"
        )
        why = (
            "v1's workers refused this name (an assert), so no v1 run trained with it"
            if kind == "NX_20250515_v2"
            else "a loss NexRL does not have"
        )
        converter.refuse(keys["loss_func_type"], why, instead)
        for name in ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "loss_agg_mode", "entropy_coeff"):
            converter.drop(keys[name], "read by a loss NexRL does not have")
        return
    name = _WORKER_LOSSES[kind]
    options: dict[str, Any] = {"algorithm.loss.name": name}
    if name == "ppo":
        low, high, both = (converter.value(keys[key]) for key in ("clip_ratio_low", "clip_ratio_high", "clip_ratio"))
        asymmetric = kind == "NX_20250515" and all(isinstance(v, (int, float)) and v > 0 for v in (low, high))
        if asymmetric:
            converter.carry(keys["clip_ratio_low"], {"algorithm.loss.options.clip_low": low})
            converter.carry(keys["clip_ratio_high"], {"algorithm.loss.options.clip_high": high})
            converter.drop(keys["clip_ratio"], "used only when clip_ratio_low or clip_ratio_high is 0")
        elif both is not ABSENT:
            converter.carry(keys["clip_ratio"], {"algorithm.loss.options.clip_low": both, "algorithm.loss.options.clip_high": both})
            for key in ("clip_ratio_low", "clip_ratio_high"):
                converter.drop(
                    keys[key],
                    f"{kind} clipped symmetrically by clip_ratio" if kind == "NX_20241031" else "not both above 0, so clip_ratio applied",
                )
    else:
        for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
            converter.drop(keys[key], "importance_sampling does not clip")
    agg = converter.value(keys["loss_agg_mode"])
    if kind == "NX_20250515":
        if agg is ABSENT:
            agg = "token-mean"
        if agg not in _AGG_MODES:
            converter.refuse(keys["loss_agg_mode"], f"aggregation {agg!r} v1 did not have", "choose algorithm.loss.options.agg_mode")
            return
        options["algorithm.loss.options.agg_mode"] = agg
    else:
        options["algorithm.loss.options.agg_mode"] = "token-mean"
        converter.drop(keys["loss_agg_mode"], f"v1's {kind} always took the token mean")
    converter.carry(keys["loss_func_type"], options)
    if kind == "NX_20250515" and converter.present(keys["loss_agg_mode"]):
        converter.carry(keys["loss_agg_mode"], {"algorithm.loss.options.agg_mode": agg})
        if agg == "seq-mean-token-sum":
            converter.ask(
                keys["loss_agg_mode"],
                "v1 divided each row's sum by its length, so it trained with seq-mean-token-mean; written: the true sum the name says; "
                "set algorithm.loss.options.agg_mode: seq-mean-token-mean to train as v1 did",
            )
    _entropy(converter, keys["entropy_coeff"], name)


def betas(converter: Converter) -> None:
    key = f"{ACTOR}optim.betas"
    value = converter.value(key)
    if value is ABSENT:
        return
    if not (isinstance(value, (list, tuple)) and len(value) == 2):
        converter.refuse(key, f"expected [beta1, beta2], got {value!r}", "set algorithm.beta1 and algorithm.beta2")
        return
    converter.carry(key, {"algorithm.beta1": value[0], "algorithm.beta2": value[1]})


def warmup(converter: Converter) -> None:
    """v1's warmup was ``int(ratio x optim.total_training_steps)`` steps, and nothing in v1
    filled that in: a ratio without it warmed up over 0 steps."""
    if converter.kind != "workers":
        return
    ratio_key, total_key, style_key = (f"{ACTOR}optim.{name}" for name in ("lr_warmup_steps_ratio", "total_training_steps", "warmup_style"))
    ratio = number(converter, ratio_key, converter.value(ratio_key))
    if ratio is not None:
        total = converter.value(total_key)
        if ratio == 0:
            converter.carry(ratio_key, {"algorithm.warmup_steps": 0})
            converter.drop(total_key, "read only for the warmup, which is 0")
        elif total is not ABSENT:
            steps = int(ratio * total)
            converter.carry(ratio_key, {"algorithm.warmup_steps": steps}, note=f"int({show(ratio)} x {show(total)})")
            converter.carry(total_key, {"algorithm.warmup_steps": steps})
        else:
            run = converter.output("schedule.steps")
            steps = int(ratio * run) if isinstance(run, int) else 0
            converter.carry(ratio_key, {"algorithm.warmup_steps": steps}, note="of schedule.steps")
            converter.ask(
                ratio_key,
                f"v1 multiplied it by optim.total_training_steps, which the recipe leaves unset, so v1 warmed up over 0 steps; "
                f"written: the warmup the recipe meant ({steps} steps); set algorithm.warmup_steps: 0 to train as v1 did",
            )
    style = converter.value(style_key)
    if style is ABSENT:
        return
    if style == "constant":
        converter.carry(style_key, {"algorithm.lr_schedule": "constant"})
    elif style in ("linear", "cosine"):
        converter.carry(style_key, {"algorithm.lr_schedule": style})
        converter.ask(
            style_key,
            f"v1 kept the rate constant after warmup whatever warmup_style said; written: {style}; set algorithm.lr_schedule: constant to train as v1 did",
        )
    else:
        converter.refuse(style_key, f"schedule {style!r}", "choose algorithm.lr_schedule (constant, linear, cosine)")


def mini_batches(converter: Converter) -> None:
    """v1's ``ppo_mini_batch_size`` counted prompts per optimizer step; NexRL splits a step into equal parts."""
    key = f"{ACTOR}ppo_mini_batch_size"
    if converter.value(key) is ABSENT:
        return
    size = number(converter, key, converter.value(key))
    prompts = converter.output("rollout.prompts_per_step")
    if size is None:
        return
    if not isinstance(prompts, int):
        converter.refuse(
            key, "the conversion needs data.batch_size to count optimizer steps", "set backend.options.update.mini_batches yourself"
        )
        return
    size = int(size)
    if size >= prompts or prompts % size == 0:
        converter.carry(key, {"backend.options.update.mini_batches": max(1, prompts // size)}, note=f"{prompts} prompts per step / {size}")
        return
    converter.refuse(
        key,
        f"v1 split each step's {prompts} prompts into optimizer steps of {size} and one of {prompts % size}; NexRL splits a step into equal parts",
        f"set backend.options.update.mini_batches ({math.ceil(prompts / size)} is closest) or make data.batch_size a multiple of it",
    )


def micro_batches(converter: Converter) -> None:
    """Rows per pass on a rank: memory only, the gradient is the same."""
    dynamic, tokens_key = converter.value(f"{ACTOR}use_dynamic_bsz"), f"{ACTOR}ppo_max_token_len_per_gpu"
    per_gpu_key, global_key = f"{ACTOR}ppo_micro_batch_size_per_gpu", f"{ACTOR}ppo_micro_batch_size"
    if dynamic is True:
        tokens = converter.value(tokens_key)
        converter.carry(f"{ACTOR}use_dynamic_bsz", {"backend.options.update.max_tokens_per_microbatch": tokens})
        converter.carry(tokens_key, {"backend.options.update.max_tokens_per_microbatch": tokens})
        for key in (per_gpu_key, global_key):
            converter.drop(key, "read only with use_dynamic_bsz false")
        return
    if converter.present(f"{ACTOR}use_dynamic_bsz"):
        converter.drop(f"{ACTOR}use_dynamic_bsz", "false: micro-batches of a fixed row count")
    converter.drop(tokens_key, "read only with use_dynamic_bsz true")
    if converter.present(per_gpu_key):
        converter.carry(per_gpu_key, {"backend.options.update.micro_batch_rows": converter.value(per_gpu_key)})
        converter.drop(global_key, "ppo_micro_batch_size_per_gpu set the rows per rank")
        return
    if not converter.present(global_key):
        return
    rows = number(converter, global_key, converter.value(global_key))
    if rows is None:
        return
    ranks = converter.output("backend.options.world_size")
    parallel = converter.value(f"{ACTOR}ulysses_sequence_parallel_size")
    parallel = 1 if parallel is ABSENT or not isinstance(parallel, int) else parallel
    data_parallel = max(1, ranks // parallel) if isinstance(ranks, int) else 1
    converter.carry(
        global_key,
        {"backend.options.update.micro_batch_rows": max(1, int(rows) // data_parallel)},
        note=f"{int(rows)} over {data_parallel} data-parallel ranks",
    )


RULES: dict[str, Callable[[Converter], None]] = {
    rule.__name__: rule
    for rule in (
        run_dir,
        backend,
        api_key,
        lora,
        world_size,
        distillation,
        op_timeout,
        model_path,
        data_files,
        prompt_key,
        prompt_limit,
        sequence_limit,
        agent,
        staleness,
        precision,
        old_logprobs,
        kl,
        loss,
        betas,
        warmup,
        mini_batches,
        micro_batches,
    )  # fmt: skip
}
"""Every rule the table may name, in the order they run (a later one reads what an earlier wrote)."""
