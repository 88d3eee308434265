"""The recipe ``nexrl train`` runs: one attrs class per YAML section.

A recipe states what it changes from the defaults. The core has no defaults for what
only a plugin provides (the backend, the task, the model): a recipe names them, as the
built-in quickstart does. Components chosen by name (backend, rollout source,
advantage estimator, policy loss) carry their own options, which are checked against
the config class the component registered; the registry kind of each such field is
recorded in its metadata under `REGISTRY_KIND`.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from nexrl_core.config.adamw import AdamWSettings
from nexrl_core.config.checks import (
    fraction,
    non_empty,
    non_negative,
    non_negative_int,
    optional_module_attribute,
    optional_non_empty,
    optional_non_negative_int,
    optional_positive_int,
    positive,
    positive_fraction,
)
from nexrl_core.config.lora import LoraSettings
from nexrl_core.config.lr_schedule import LRSchedule

MAX_AUTO_CONCURRENCY = 256
"""Most agent runs (threads) ``rollout.concurrency: null`` keeps in flight."""

REGISTRY_KIND = "nexrl_registry_kind"
"""Metadata key of a `ComponentChoice` field: the registry its ``name`` is looked up in."""
REGISTRY_LIST_KIND = "nexrl_registry_list_kind"
"""Metadata key of a field holding several chosen components (`ChoiceList`): the
registry their names are looked up in."""


class DType(str, enum.Enum):
    """Precision the model's weights are trained in."""

    FP32 = "fp32"
    BF16 = "bf16"

    @property
    def torch_name(self) -> str:
        """The name torch gives it (``float32``, ``bfloat16``): what backends report running."""
        return {"fp32": "float32", "bf16": "bfloat16"}[self.value]


class KLController(str, enum.Enum):
    """How the KL coefficient evolves during training."""

    FIXED = "fixed"
    """Keep ``coef`` constant."""
    ADAPTIVE = "adaptive"
    """Move the coefficient so the measured KL tracks ``target``."""


class KLPenalty(str, enum.Enum):
    """Per-token estimator of KL(policy || reference)."""

    KL = "kl"
    """``logp - ref`` (k1): unbiased, may be negative per token."""
    ABS = "abs"
    """``|logp - ref|``."""
    MSE = "mse"
    """``(logp - ref)^2 / 2`` (k2)."""
    LOW_VAR_KL = "low_var_kl"
    """``exp(ref - logp) - (ref - logp) - 1`` (k3): non-negative, low variance."""


class PromptOverflow(str, enum.Enum):
    """What a model call whose prompt is longer than ``rollout.max_prompt_tokens`` gets."""

    ERROR = "error"
    """The training run (or evaluation) stops at once with one line naming the key, the
    limit, the prompt's length and the task item: a prompt that long is a mistake in
    the data or the agent, and training on less than it says would hide it."""
    TRUNCATE_LEFT = "truncate_left"
    """The call is sampled after the prompt's last ``max_prompt_tokens`` tokens, so the
    generation prompt (the template's opening of the assistant turn) survives and the
    start of the conversation (system prompt, first turns) is dropped. The trajectory
    holds exactly the tokens the model saw; a multi-turn agent's truncated turn no
    longer continues the previous turn's tokens, so it starts a trajectory of its own
    (trained on its truncated prompt, with the run's reward and a fresh
    ``max_response_tokens`` budget)."""
    SKIP = "skip"
    """The agent run ends at that call and is dropped: nothing of it is trained on, it is
    counted in ``rollout/skipped_runs`` (``val/rollout/skipped_runs`` in validation) and
    not against ``rollout.error_budget`` or ``max_agent_errors``, the recipe having
    chosen to drop over-long items. Its group trains on the runs that remain."""


@attrs.frozen(kw_only=True)
class ComponentChoice:
    """A registered component picked by name, with options for its own config class."""

    name: str | None = attrs.field(default=None, validator=optional_non_empty)
    """Registered name, e.g. ``grpo``; ``nexrl plugins`` lists what is installed. Null
    where the core has no default: the run then stops and lists the installed choices."""
    options: dict[str, Any] = attrs.field(factory=dict)
    """Structured into the component's config class when the recipe is resolved; an
    option left out takes the component's default."""


ChoiceList = list[str | ComponentChoice]
"""Several components of one kind: each a registered name, or ``{name, options}`` for
one with options."""


def as_choices(entries: ChoiceList) -> list[ComponentChoice]:
    """A `ChoiceList` with each bare name as a choice with no options."""
    return [ComponentChoice(name=entry) if isinstance(entry, str) else entry for entry in entries]


def _component(kind: str, default: str | None) -> Any:
    return attrs.field(factory=lambda: ComponentChoice(name=default), metadata={REGISTRY_KIND: kind})


@attrs.frozen(kw_only=True)
class DatasetSpec:
    """Items read through Hugging Face ``datasets``: a directory ``save_to_disk`` wrote
    (``path``, with ``split`` when it holds several), or a ``load_dataset`` call on local
    files (``builder``, ``data_files``, ``split``). A plain string in ``task.data_path``
    is the same as ``{path: ...}``."""

    path: str | None = attrs.field(default=None, validator=optional_non_empty)
    """A JSONL or parquet file, or a directory ``Dataset.save_to_disk`` or
    ``DatasetDict.save_to_disk`` wrote."""
    builder: str | None = attrs.field(default=None, validator=optional_non_empty)
    """A ``datasets`` packaged builder (``json``, ``parquet``, ``csv``, ``arrow``, ``text``)
    or a local dataset directory, as the first argument of ``load_dataset``."""
    data_files: list[str] = attrs.field(factory=list)
    """With ``builder``: the files (globs allowed) of the split read."""
    split: str | None = attrs.field(default=None, validator=optional_non_empty)
    """Which split to read: of a ``DatasetDict`` directory, or of ``builder`` (default ``train``)."""

    def __attrs_post_init__(self) -> None:
        if (self.path is None) == (self.builder is None):
            raise ValueError("set exactly one of path (a file or a save_to_disk directory) and builder (load_dataset)")
        if self.data_files and self.builder is None:
            raise ValueError("data_files goes with builder; for a single file set path alone")


DataPath = str | DatasetSpec | None
"""What ``task.data_path`` and ``task.val_data_path`` take: a path, or a `DatasetSpec`."""


@attrs.frozen(kw_only=True)
class TaskConfig:
    """What to train on: prompts, the agent that answers them, and its reward."""

    name: str | None = attrs.field(default=None, validator=optional_non_empty)
    """A registered task (``nexrl plugins`` lists them), or null for a task given by
    ``data_path`` and ``agent``."""
    data_path: DataPath = None
    """Training items: a JSONL file, a parquet file (verl's layout: a ``prompt`` column of
    chat messages beside the fields the agent reads), a ``save_to_disk`` directory, or a
    `DatasetSpec` mapping; null uses the built-in task's data."""
    val_data_path: DataPath = None
    """Held-out items, in any form ``data_path`` takes; null validates on the built-in
    task's split, if any."""
    columns: list[str] | None = None
    """Fields every training and held-out item must have (the ones the agent reads;
    ``a.b`` is field ``b`` inside ``a``), checked in every data file before anything
    starts; null checks none."""
    agent: str | None = attrs.field(default=None, validator=optional_module_attribute)
    """Rollout function as ``package.module:function``; null uses the built-in task's agent.
    The recipe's directory and the current directory are searched for the module too."""
    val_size: int | None = attrs.field(default=None, validator=optional_positive_int)
    """Validate on the first this many held-out items; null uses all of them."""


def _needs_bf16(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """``mixed_precision`` mixes bf16 compute with fp32 masters; under fp32 there is no
    bf16 to mix, and accepting it would silently change nothing."""
    if value and instance.dtype is not DType.BF16:
        raise ValueError(
            f"mixed_precision: true needs dtype: bf16 (it keeps fp32 master weights under bf16 compute; with dtype: "
            f"{instance.dtype.value} every weight is fp32 already); set model.dtype: bf16 or remove model.mixed_precision"
        )


@attrs.frozen(kw_only=True)
class ModelConfig:
    """The policy being trained."""

    name: str | None = attrs.field(default=None, validator=optional_non_empty)
    """Model name or path as the backend knows it (``nexrl-tiny``, the model nexrl-engine
    ships, or a local Hugging Face directory)."""
    lora: LoraSettings = attrs.field(factory=LoraSettings)
    """Which weights train: every one (``rank`` 0, the default) or LoRA adapters."""
    dtype: DType = DType.FP32
    """Precision of the trained weights; with ``mixed_precision``, of the compute and the
    sampled weights over fp32 masters."""
    gradient_checkpointing: bool = False
    """Activation checkpointing in training passes: each decoder layer's activations are
    recomputed in the backward pass instead of kept, trading compute for memory; the
    gradients are the same. Sampling is unaffected. The remote_api backend refuses it
    (the Tinker and Weaver APIs have no such setting)."""
    mixed_precision: bool = attrs.field(default=False, validator=_needs_bf16)
    """With ``dtype: bf16``: keep fp32 master weights and fp32 AdamW moments while the
    forward and backward passes compute in bf16. Pure bf16 loses every update smaller
    than half a bf16 step of the weight (0.2 to 0.4 % of it), so small learning rates
    stop moving it; the fp32 masters keep those updates. Sampling uses the bf16 weights
    the masters round to; checkpoints hold the fp32 masters and their optimizer state,
    exports the bf16 weights sampling used. The in-process engine and the self-hosted
    workers (FSDP2's ``MixedPrecisionPolicy``) honour it; the remote_api backend refuses
    it (the Tinker and Weaver APIs have no such setting). With ``dtype: fp32`` every
    weight is fp32 already, so it is refused there."""


def _read_only_with_a_prompt_limit(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """``prompt_overflow`` says what happens past ``max_prompt_tokens``; with no limit
    nothing would read it, so a value other than the default is refused."""
    if value != attribute.default and instance.max_prompt_tokens is None:
        raise ValueError(
            f"{attribute.name}: {PromptOverflow(value).value} has no effect while max_prompt_tokens is null (no limit); "
            "set rollout.max_prompt_tokens or remove it"
        )


def _read_only_with_kl_on(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A KL setting other than its default must be one the run reads: none is read while
    ``coef`` is 0, and ``target``/``horizon`` only by the adaptive controller."""
    if value == attribute.default:
        return
    if instance.coef == 0:
        raise ValueError(f"{attribute.name} has no effect while coef is 0 (KL off); set algorithm.kl.coef > 0 or remove it")
    if attribute.name in ("target", "horizon") and instance.controller is KLController.FIXED:
        raise ValueError(f"{attribute.name} is read only by the adaptive controller; set algorithm.kl.controller: adaptive or remove it")


@attrs.frozen(kw_only=True)
class KLSettings:
    """Penalty on drifting from the reference model."""

    coef: float = attrs.field(default=0.0, validator=non_negative)
    """Weight of the KL penalty (the adaptive controller's starting value); 0 disables it."""
    controller: KLController = attrs.field(default=KLController.FIXED, validator=_read_only_with_kl_on)
    """``fixed`` keeps ``coef``; ``adaptive`` steers it towards ``target``."""
    target: float = attrs.field(default=6.0, validator=[positive, _read_only_with_kl_on])
    """KL the adaptive controller aims for (set it only with ``controller: adaptive``)."""
    horizon: int = attrs.field(default=10000, validator=[positive, _read_only_with_kl_on])
    """Steps over which the adaptive controller adjusts the coefficient; larger is slower
    (set it only with ``controller: adaptive``)."""
    penalty: KLPenalty = attrs.field(default=KLPenalty.KL, validator=_read_only_with_kl_on)
    """Per-token KL estimator."""


@attrs.frozen(kw_only=True)
class AlgorithmConfig(AdamWSettings):
    """How rewards become gradients, and the optimizer that applies them: the AdamW
    fields (``learning_rate``, ``beta1``, ``beta2``, ``eps``, ``weight_decay``,
    ``grad_clip_norm``) are `AdamWSettings`'s, so they reach every backend's optimizer."""

    advantage: ComponentChoice = _component("advantage_estimators", "grpo")
    """Advantage estimator."""
    loss: ComponentChoice = _component("policy_losses", "importance_sampling")
    """Policy loss."""
    kl: KLSettings = attrs.field(factory=KLSettings)
    """KL penalty against the reference model."""
    lr_schedule: LRSchedule = LRSchedule.CONSTANT
    """How the learning rate moves over ``schedule.steps``: ``constant``, ``linear`` (to 0 at
    the last step) or ``cosine`` (half a cosine to 0 at the last step), after any warmup;
    `nexrl_core.config.lr_schedule.scheduled_learning_rate` is the formula."""
    warmup_steps: int = attrs.field(default=0, validator=non_negative_int)
    """Steps over which the rate ramps up linearly (step s of the first ``warmup_steps``
    gets ``s / warmup_steps`` of it); 0: no warmup."""


@attrs.frozen(kw_only=True)
class RolloutConfig:
    """How experience is collected each step."""

    source: ComponentChoice = _component("rollout_sources", "threads")
    """Where runs happen: ``threads`` runs the task's agent function on a thread pool
    in this process; plugins add others."""
    prompts_per_step: int = attrs.field(default=16, validator=positive)
    """Distinct prompts per training step."""
    group_size: int = attrs.field(default=8, validator=positive)
    """Runs per prompt; group-relative estimators compare the runs of one prompt."""
    max_tokens: int = attrs.field(default=8, validator=positive)
    """Most tokens sampled per model turn (an agent's own ``max_tokens`` replaces it for
    its call); ``max_response_tokens`` may cap it further."""
    max_prompt_tokens: int | None = attrs.field(default=None, validator=optional_positive_int)
    """Most tokens a model turn's prompt may have: the chat-templated conversation so far
    (tools included), or a raw prompt's token ids. ``prompt_overflow`` says what happens
    to a longer one; null sets no limit. Every rollout source enforces it on every
    backend (`nexrl_core.run.limits`), in validation and ``nexrl eval`` too; with
    ``max_tokens`` it must fit the model's context where the backend knows it."""
    prompt_overflow: PromptOverflow = attrs.field(default=PromptOverflow.ERROR, validator=_read_only_with_a_prompt_limit)
    """What a prompt over ``max_prompt_tokens`` gets: ``error`` (the run stops, naming the
    key, the limit, the prompt's length and the task item), ``truncate_left`` (the last
    ``max_prompt_tokens`` tokens are kept, so the generation prompt survives) or
    ``skip`` (the agent run is dropped, not counted against ``error_budget``). Set it
    only with ``max_prompt_tokens``."""
    max_response_tokens: int | None = attrs.field(default=None, validator=optional_positive_int)
    """Most tokens the policy generates in one trajectory, all its model turns together
    (a turn continuing the previous turn's tokens is the same trajectory, as
    `nexrl_core.run.rollout.build_trajectories` builds them). Each turn's ``max_tokens`` is
    capped by what remains; the turn that uses the last of it ends with finish reason
    ``length``, as a turn cut by ``max_tokens`` does, and a later turn of the same
    trajectory is answered at once with no tokens and finish reason ``length``. Null
    sets no limit."""
    temperature: float = attrs.field(default=1.0, validator=positive)
    """Sampling temperature."""
    top_p: float = attrs.field(default=1.0, validator=positive_fraction)
    """Nucleus sampling mass; 1 samples from the whole distribution."""
    concurrency: int | None = attrs.field(default=None, validator=optional_positive_int)
    """Agent runs in flight at once (one thread each); null runs a whole step at once,
    ``prompts_per_step * group_size`` capped at 256, so that the service can batch
    every sampling request of the step (see `RolloutConfig.runs_in_flight`)."""
    max_staleness: int = attrs.field(default=0, validator=non_negative)
    """How many weight updates old a trajectory may be when trained on; 0 is fully on-policy.
    With 1 (one-step-off), the rollouts of step k+1 are generated while step k trains,
    with the weights of step k-1; the backend must allow sampling during training."""
    error_budget: float = attrs.field(default=0.1, validator=fraction)
    """Fraction of a step's runs that may fail (agent exceptions) before the run stops."""
    max_agent_errors: int | None = attrs.field(default=None, validator=optional_non_negative_int)
    """Failed agent runs allowed over the whole run (training and validation) before it
    stops; null sets no total limit."""
    val_temperature: float = attrs.field(default=1.0, validator=non_negative)
    """Sampling temperature of validation runs (one run per held-out item); 0 is greedy.
    The default samples at temperature 1, so validation measures the policy being trained."""

    def runs_in_flight(self) -> int:
        """``concurrency``, or for null a whole step's runs, at most `MAX_AUTO_CONCURRENCY`."""
        if self.concurrency is not None:
            return self.concurrency
        return min(self.prompts_per_step * self.group_size, MAX_AUTO_CONCURRENCY)


@attrs.frozen(kw_only=True)
class ScheduleConfig:
    """How long to train and when to validate and save."""

    steps: int = attrs.field(default=40, validator=positive)
    """Training steps."""
    validate_every: int = attrs.field(default=5, validator=non_negative)
    """Validate every this many steps; 0 never validates."""
    checkpoint_every: int = attrs.field(default=10, validator=non_negative)
    """Save a checkpoint every this many steps; 0 disables periodic checkpoints."""


@attrs.frozen(kw_only=True)
class OutputConfig:
    """Where a run writes metrics, plots and checkpoints."""

    dir: str = attrs.field(default="runs/latest", validator=non_empty)
    """Output directory, created if missing."""
    sinks: ChoiceList | None = attrs.field(default=None, metadata={REGISTRY_LIST_KIND: "metrics_sinks"})
    """Trackers the metric rows also go to (``metrics.jsonl``, the reward curve and the
    progress display are always written): registered metrics sinks by name, e.g.
    ``[tensorboard, wandb]``, or ``{name: wandb, options: {project: demo}}`` for one with
    options (``nexrl plugins`` lists the installed sinks). Null uses every installed
    sink that registers itself as a default; ``[]`` uses none."""


@attrs.frozen(kw_only=True)
class TeacherConfig:
    """A frozen second model that scores the student's sampled tokens, for on-policy
    distillation: an advantage estimator that reads teacher log-probs (``nexrl plugins``
    lists them) compares the two models on every trained token. Only backends that can
    hold a second model run it; the others refuse it before step 1."""

    model: str | None = attrs.field(default=None, validator=optional_non_empty)
    """Name or path of the teacher as the backend knows it (a shipped model or a local
    Hugging Face directory, e.g. a run's ``final_model``); it must share the student's
    tokenizer, since it scores the student's token ids. Null: no teacher."""


@attrs.frozen(kw_only=True)
class TrainConfig:
    """A whole recipe for ``nexrl train``."""

    task: TaskConfig = attrs.field(factory=TaskConfig)
    """What to train on."""
    backend: ComponentChoice = _component("backends", None)
    """Where sampling and training run: a registered backend (``nexrl plugins`` lists
    them) and its options."""
    model: ModelConfig = attrs.field(factory=ModelConfig)
    """The policy being trained."""
    teacher: TeacherConfig = attrs.field(factory=TeacherConfig)
    """A frozen model whose log-probs the advantage estimator reads (on-policy distillation)."""
    algorithm: AlgorithmConfig = attrs.field(factory=AlgorithmConfig)
    """Advantage estimator, loss, KL penalty and optimizer."""
    rollout: RolloutConfig = attrs.field(factory=RolloutConfig)
    """How experience is collected."""
    schedule: ScheduleConfig = attrs.field(factory=ScheduleConfig)
    """Steps, validation and checkpoint cadence."""
    output: OutputConfig = attrs.field(factory=OutputConfig)
    """Where results go."""
    seed: int = attrs.field(default=0, validator=non_negative)
    """Seeds data order, sampling and initialisation, so a run can be repeated."""
