"""The recipe ``nexrl train`` runs: one attrs class per YAML section.

Every field has a default, so an empty file is a valid recipe (the addition task on
the tiny model through the embedded local service) and a recipe states only what it
changes. Components chosen by name (advantage estimator, policy loss) carry their own
options, which are checked against the config class the component registered; the
registry kind of each such field is recorded in its metadata under `REGISTRY_KIND`.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from nexrl_core.config.checks import (
    fraction,
    fraction_below_one,
    non_empty,
    non_negative,
    optional_http_url,
    optional_module_attribute,
    optional_non_empty,
    optional_non_negative_int,
    optional_positive_int,
    positive,
    positive_fraction,
)

MAX_AUTO_CONCURRENCY = 256
"""Most agent runs (threads) ``rollout.concurrency: null`` keeps in flight."""

REGISTRY_KIND = "nexrl_registry_kind"
"""Metadata key of a `ComponentChoice` field: the registry its ``name`` is looked up in."""


class DType(str, enum.Enum):
    """Precision the model's weights are trained in."""

    FP32 = "fp32"
    BF16 = "bf16"


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


@attrs.frozen(kw_only=True)
class ComponentChoice:
    """A registered component picked by name, with options for its own config class."""

    name: str = attrs.field(validator=non_empty)
    """Registered name, e.g. ``grpo``; ``nexrl plugins`` lists what is installed."""
    options: dict[str, Any] = attrs.field(factory=dict)
    """Structured into the component's config class when the recipe is resolved; an
    option left out takes the component's default."""


def _component(kind: str, default: str) -> Any:
    return attrs.field(factory=lambda: ComponentChoice(name=default), metadata={REGISTRY_KIND: kind})


@attrs.frozen(kw_only=True)
class TaskConfig:
    """What to train on: prompts, the agent that answers them, and its reward."""

    name: str = attrs.field(default="addition", validator=non_empty)
    """A built-in task (``addition``), or a label for a task given by ``data_path`` and ``agent``."""
    data_path: str | None = None
    """JSONL file of training prompts; null uses the built-in task's data."""
    val_data_path: str | None = None
    """JSONL file of validation prompts; null validates on the built-in task's split, if any."""
    agent: str | None = attrs.field(default=None, validator=optional_module_attribute)
    """Rollout function as ``package.module:function``; null uses the built-in task's agent.
    The recipe's directory and the current directory are searched for the module too."""
    val_size: int | None = attrs.field(default=None, validator=optional_positive_int)
    """Validate on the first this many held-out items; null uses all of them."""


@attrs.frozen(kw_only=True)
class BackendConfig:
    """Where sampling and training run."""

    service_holder: str = attrs.field(default="tinker", validator=non_empty)
    """Registered service holder that talks to the backend (``tinker``, ``weaver``, ...)."""
    base_url: str | None = attrs.field(default=None, validator=optional_http_url)
    """URL of a running service; null starts NexRL's own service on 127.0.0.1 for the run."""
    api_key_env: str = attrs.field(default="TINKER_API_KEY", validator=non_empty)
    """Name of the environment variable holding the API key, so the key never sits in a recipe."""
    trainer: str = attrs.field(default="remote_api_grpo", validator=non_empty)
    """Registered trainer that turns trajectories into updates on this backend."""
    service: str | None = attrs.field(default=None, validator=optional_non_empty)
    """Registered service started in the background when ``base_url`` is null; null means
    the service named like ``service_holder`` (``nexrl serve NAME`` runs the same one)."""
    options: dict[str, Any] = attrs.field(factory=dict)
    """Options of the service holder's own config class, checked against it when the run
    starts. ``base_url``, ``base_model``/``model``, ``lora_rank``, ``dtype``, ``api_key``
    and ``seed`` are filled in from the recipe when the class has such a field."""


@attrs.frozen(kw_only=True)
class ModelConfig:
    """The policy being trained."""

    name: str = attrs.field(default="nexrl-tiny", validator=non_empty)
    """Model name or path as the backend knows it; ``nexrl-tiny`` is the model NexRL ships."""
    lora_rank: int = attrs.field(default=0, validator=non_negative)
    """Rank of the LoRA adapters; 0 trains every weight."""
    dtype: DType = DType.FP32
    """Precision of the trained weights."""


@attrs.frozen(kw_only=True)
class KLSettings:
    """Penalty on drifting from the reference model."""

    coef: float = attrs.field(default=0.0, validator=non_negative)
    """Weight of the KL penalty (the adaptive controller's starting value); 0 disables it."""
    controller: KLController = KLController.FIXED
    """``fixed`` keeps ``coef``; ``adaptive`` steers it towards ``target``."""
    target: float = attrs.field(default=6.0, validator=positive)
    """KL the adaptive controller aims for; ignored by ``fixed``."""
    horizon: int = attrs.field(default=10000, validator=positive)
    """Steps over which the adaptive controller adjusts the coefficient; larger is slower."""
    penalty: KLPenalty = KLPenalty.KL
    """Per-token KL estimator."""


@attrs.frozen(kw_only=True)
class AlgorithmConfig:
    """How rewards become gradients, and the optimizer that applies them."""

    advantage: ComponentChoice = _component("advantage_estimators", "grpo")
    """Advantage estimator."""
    loss: ComponentChoice = _component("policy_losses", "importance_sampling")
    """Policy loss."""
    kl: KLSettings = attrs.field(factory=KLSettings)
    """KL penalty against the reference model."""
    learning_rate: float = attrs.field(default=1e-4, validator=positive)
    """AdamW learning rate."""
    beta1: float = attrs.field(default=0.9, validator=fraction_below_one)
    """AdamW first-moment decay."""
    beta2: float = attrs.field(default=0.95, validator=fraction_below_one)
    """AdamW second-moment decay."""
    eps: float = attrs.field(default=1e-8, validator=positive)
    """AdamW denominator epsilon."""
    weight_decay: float = attrs.field(default=0.01, validator=non_negative)
    """AdamW decoupled weight decay."""
    grad_clip_norm: float = attrs.field(default=1.0, validator=positive)
    """Gradients are rescaled so their global norm is at most this."""


@attrs.frozen(kw_only=True)
class RolloutConfig:
    """How experience is collected each step."""

    prompts_per_step: int = attrs.field(default=16, validator=positive)
    """Distinct prompts per training step."""
    group_size: int = attrs.field(default=8, validator=positive)
    """Runs per prompt; group-relative estimators compare the runs of one prompt."""
    max_tokens: int = attrs.field(default=8, validator=positive)
    """Most tokens sampled per model turn."""
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


@attrs.frozen(kw_only=True)
class TrainConfig:
    """A whole recipe for ``nexrl train``."""

    task: TaskConfig = attrs.field(factory=TaskConfig)
    """What to train on."""
    backend: BackendConfig = attrs.field(factory=BackendConfig)
    """Where sampling and training run."""
    model: ModelConfig = attrs.field(factory=ModelConfig)
    """The policy being trained."""
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
