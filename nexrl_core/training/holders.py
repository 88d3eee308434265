"""The service holder: one object that both samples from and trains a model on a backend.

Rollout workers and the trainer share one holder, so sampling always sees the weights
the trainer last published. A holder must survive being pickled into another process
(for rollout workers elsewhere): it pickles to its config and reconnects on first use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol, Union

import attrs

from nexrl_core.chat.model import ChatModel
from nexrl_core.config.adamw import AdamWSettings
from nexrl_core.config.checks import optional_non_empty
from nexrl_core.config.lora import DEFAULT_ALPHA
from nexrl_core.config.schema import DType, ModelConfig
from nexrl_core.http.capabilities import NexrlCapabilities
from nexrl_core.training.backend import CONTEXT_KEY
from nexrl_core.types import RemoteDatum


@attrs.frozen(kw_only=True)
class HolderTarget:
    """What every service holder's config starts with: the model to train and where.

    A holder's config class subclasses it and adds its own options; the backend that
    builds the holder fills these from the recipe (``model``, ``seed``, ``teacher``) and
    from how it reached the service (``base_url``, ``api_key``).
    """

    model: ModelConfig
    """The recipe's model section: name, LoRA rank (0 trains every weight), dtype."""
    seed: int = 0
    """Seeds LoRA initialisation and anything else the holder draws at random."""
    base_url: str | None = None
    """Service URL; None lets the holder use its SDK's default."""
    api_key: str | None = None
    """Service API key; None lets the holder's SDK read its own environment variable."""
    teacher: str | None = attrs.field(default=None, validator=optional_non_empty)
    """The recipe's ``teacher.model``, for a holder that scores tokens under it
    (`TeacherHolder`); None: no teacher."""


LossOptionValue = Union[float, int, str, bool]
"""A loss option as it travels: numbers, and enum members by their string value."""


@attrs.frozen(kw_only=True)
class TrainStepConfig:
    """One optimisation step on a remote API: the loss with all its options, and AdamW."""

    loss_fn: str = "importance_sampling"
    """Loss name understood by the backend (and by NexRL's policy-loss registry)."""
    loss_fn_config: dict[str, LossOptionValue] = attrs.field(factory=dict)
    """Every option of the loss's config class as NexRL names it (``clip_low``,
    ``agg_mode``, ``entropy_coeff``, ...); options left at None are absent. A holder
    translates them into its backend's vocabulary, or refuses those it cannot honour
    (see `ServiceHolder.refused_options`)."""
    optimizer: AdamWSettings = attrs.field(factory=AdamWSettings)
    """Every AdamW parameter; all of them reach the optimizer."""


class ServiceHolder(ChatModel, Protocol):
    """Sampling and training on one backend; see ``docs/plugins.md``."""

    def refused_options(self, config: TrainStepConfig) -> dict[str, str]:
        """What this holder cannot honour, by key (``loss_fn_config.<option>``,
        ``optimizer.<field>``, or ``model.<field>`` of its own `HolderTarget`), each
        with what to do instead; empty when everything is honoured. Asked before the
        first step, so a run never trains with a setting that is silently dropped."""
        ...

    def reference_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Per sequence, ``log p_ref(token[i] | tokens[:i])`` under the base model's
        weights (the reference of a KL penalty), with 0.0 at position 0."""
        ...

    def train(self, datums: Sequence[RemoteDatum], config: TrainStepConfig) -> dict[str, float]:
        """One forward-backward pass over ``datums`` and one optimizer step; returns metrics."""
        ...

    def update_sampling_weights(self, weight_path: str | None = None) -> str:
        """Point sampling at ``weight_path``, or at freshly saved current weights; returns the path."""
        ...

    def save_checkpoint(self, name: str) -> str:
        """Save weights and optimizer state under ``name``; returns a path `load_checkpoint` takes."""
        ...

    def load_checkpoint(self, path: str) -> None:
        """Continue training from a checkpoint saved by `save_checkpoint` (weights and optimizer)."""
        ...

    def export_model(self, directory: Path) -> Path:
        """Write the weights of the last `update_sampling_weights` into ``directory`` as
        a plain Hugging Face model directory (see `nexrl_core.training.backend.Backend.export_model`:
        weights, config, tokenizer, chat template; LoRA merged, the adapter also in PEFT
        layout in ``directory / "adapter"``), through the backend's own download API
        where it is a remote service. Returns ``directory``.

        :raises nexrl_core.training.model_export.ModelExportError: when the backend cannot.
        """
        ...

    def run_info(self) -> Mapping[str, str]:
        """How the model really runs, as far as the holder knows (``dtype``, ``device``):
        `nexrl_core.training.backend.Backend.run_info` of a backend over this holder. Empty when a
        remote service does not say."""
        ...

    def close(self) -> None:
        """Release connections and background threads."""
        ...


class TeacherHolder(ServiceHolder, Protocol):
    """A holder that also holds the recipe's ``teacher``: what a backend with capability
    `nexrl_core.training.backend.TEACHER_BACKEND` gives its trainer."""

    def teacher_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Per sequence, ``log p_teacher(token[i] | tokens[:i])`` under the frozen
        teacher, with 0.0 at position 0: aligned as `ServiceHolder.reference_logprobs` is."""
        ...


def fixed_precision_refusals(model: ModelConfig, api: str, service: NexrlCapabilities | None) -> dict[str, str]:
    """What a training API without dtype, mixed-precision, LoRA-alpha or checkpointing settings
    cannot honour of ``model``, as `ServiceHolder.refused_options` entries; ``api`` names it
    in the reasons.

    The precision is the service's own: a NexRL service says which it trains in
    (``service``), and ``model.dtype`` must match it; a hosted service does not say, so
    only the default is accepted. Neither API can ask for fp32 master weights, and a
    NexRL service started by hand or embedded trains in one dtype (``--dtype``), so
    ``model.mixed_precision`` is refused. Adapters are scaled by the default alpha.
    Activation checkpointing is the service's business: ``model.gradient_checkpointing``
    is refused.
    """
    refused: dict[str, str] = {}
    requested = model.dtype.value
    if service is not None and requested != service.dtype:
        refused["model.dtype"] = (
            f"the {api} service trains in {service.dtype}; set model.dtype: {service.dtype}, or start it with "
            f"`nexrl serve {api.lower()} --dtype {requested}` (the embedded service of a run without a base_url does)"
        )
    elif service is None and requested != DType.FP32.value:
        refused["model.dtype"] = (
            f"the {api} API has no dtype setting and a hosted service does not say which it trains in; "
            "use fp32, or a NexRL service started with --dtype, or backend.name=inprocess"
        )
    if model.gradient_checkpointing:
        refused["model.gradient_checkpointing"] = (
            f"the {api} API has no activation-checkpointing setting (the service decides how it keeps activations); "
            "remove it, or use backend.name=inprocess or self-hosted"
        )
    if model.mixed_precision:
        refused["model.mixed_precision"] = (
            f"the {api} API has no mixed-precision setting (the service keeps its weights in the one dtype it trains in); "
            "remove it, or use backend.name=inprocess or self-hosted"
        )
    if model.lora.is_lora and model.lora.alpha != DEFAULT_ALPHA:
        refused["model.lora.alpha"] = (
            f"the {api} API has no LoRA alpha (NexRL's local {api} service scales by {DEFAULT_ALPHA:g}/rank); "
            "remove it, or use backend.name=inprocess"
        )
    return refused


def service_run_info(service: NexrlCapabilities | None) -> dict[str, str]:
    """`ServiceHolder.run_info` of a holder of a remote API: the dtype a NexRL service
    reports (in torch's terms, as the local backends report theirs), the device its
    engines live on and its model's context; nothing for a hosted service."""
    if service is None:
        return {}
    info = {"dtype": DType(service.dtype).torch_name}
    if service.device:
        info["device"] = service.device
    if service.max_context_length:
        info[CONTEXT_KEY] = str(service.max_context_length)
    return info
