"""`EngineHolder`: a `nexrl_core.training.holders.ServiceHolder` on an `Engine` in this process.

No service and no HTTP: the fastest path on one machine, and the baseline that the
service backends' overhead is measured against. Four engines at most share the
process, each with its own weights:

* the training engine, which ``train`` steps and checkpoints save and load;
* the sampler, a second engine that sampling uses. ``update_sampling_weights`` copies
  the trained weights into it in memory, so rollouts keep sampling from the weights
  they were given while the next step trains (bounded staleness needs exactly that);
  ``export_model`` writes its weights;
* the reference for a KL penalty: for LoRA the training engine with its adapters
  switched off, for full fine-tuning a frozen engine of the base weights, loaded from
  the model directory on first use (so it is right after a resume too);
* the recipe's teacher (on-policy distillation): a frozen engine of another model,
  loaded with the holder so a teacher that cannot load, or whose tokenizer differs from
  the student's, stops the run before step 1. It scores tokens as the reference does.

Every torch call runs on one `ComputeThread`, which batches the rollouts' concurrent
sample requests into few engine calls; the chat half (`EngineChat`: templates, stops,
replies from `TemplateChat`) is shared with the self-hosted backend's sampler. The holder
is a `TemplateChatModel` over the same `TemplateChat`, so it renders and samples from
messages as every other holder does, and samples prompts through its `EngineChat`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from nexrl_core.chat.holder import TemplateChatModel
from nexrl_core.chat.model import SamplingOptions
from nexrl_core.config.errors import ConfigError
from nexrl_core.config.lora import LoraSettings
from nexrl_core.training.holders import TrainStepConfig
from nexrl_core.types import RemoteDatum, SampleResult
from nexrl_engine.chat import EngineChat
from nexrl_engine.config import EngineConfig
from nexrl_engine.engine import Engine
from nexrl_engine.inprocess.config import EngineHolderConfig
from nexrl_engine.lora import adapters_disabled
from nexrl_engine.loss_fns import build_loss_fn
from nexrl_engine.recipe_checks import teacher_tokenizer_problem
from nexrl_engine.types import Datum

__all__ = ["EngineHolder", "engine_datum"]

logger = logging.getLogger(__name__)

DATUM_INPUTS = frozenset({"old_logprobs", "advantages"})
"""What a loss may need from a `RemoteDatum` beyond the target tokens and the loss mask."""


def _frozen_engine(config: EngineConfig) -> Engine:
    """An engine that only scores: no mixed precision (it keeps no masters), no gradients."""
    engine = Engine(attrs.evolve(config, mixed_precision=False, gradient_checkpointing=False))
    engine.model.requires_grad_(False)
    return engine


def engine_datum(datum: RemoteDatum) -> Datum:
    """The engine's datum: the loss mask as ``weights`` (the mask of every loss, and
    cross-entropy's per-token weight), the sampler's logprobs and the advantages."""
    return Datum(
        input_tokens=datum.input_tokens,
        loss_fn_inputs={
            "target_tokens": datum.target_tokens,
            "weights": datum.loss_mask,
            "logprobs": datum.sampling_logprobs,
            "advantages": datum.advantages,
        },
    )


class EngineHolder(TemplateChatModel):
    """Samples and trains an in-process `Engine`; checkpoints go under ``checkpoint_dir``.

    It cannot be pickled: the model lives in this process, so rollouts must run here
    too (use a service backend for rollouts elsewhere).

    :raises ValueError: for a model that cannot be found or loaded, or bad engine options;
        a `ConfigError` naming ``teacher.model`` for a teacher that cannot serve.
    """

    def __init__(self, config: EngineHolderConfig, checkpoint_dir: Path) -> None:
        self.config = config
        self.checkpoint_dir = Path(checkpoint_dir)
        engine_config = config.engine_config()
        self.engine = Engine(engine_config)
        """What trains, and what checkpoints hold."""
        self.sampler = Engine(attrs.evolve(engine_config, gradient_checkpointing=False, mixed_precision=False))
        """What rollouts sample from: the weights of the last `update_sampling_weights`
        (with mixed precision the bfloat16 weights the masters round to; it keeps no masters)."""
        self._reference: Engine | None = None
        self._teacher = None if config.teacher is None else self._load_teacher(config.teacher)
        trained = dict(self.engine.model.named_parameters())
        published = set(self.engine.trainable_parameter_names())
        self._published = [(parameter, trained[name]) for name, parameter in self.sampler.model.named_parameters() if name in published]
        """(sampler parameter, training parameter) pairs that publishing copies: every
        weight for full fine-tuning, the adapters for LoRA (the base is the same); with
        mixed precision the training model's bfloat16 compute copy of the masters."""
        self._version = 0
        self._sampling = EngineChat(self.sampler, config.engine)
        self._chat = self._sampling.template_chat
        self.compute = self._sampling.compute
        """The one thread every torch call of this holder runs on."""

    def __getstate__(self) -> Any:
        raise TypeError(
            "EngineHolder holds its model in this process and cannot be pickled; run rollouts in the training "
            "process, or use a backend with a service (remote_api) for rollouts elsewhere"
        )

    # --- sampling (chat templates and messages: `TemplateChatModel`) ---------------------------

    def sample_from_prompt(self, prompt_tokens: Sequence[int], options: SamplingOptions) -> SampleResult:
        return self._sampling.sample_from_prompt(prompt_tokens, options)

    # --- training ------------------------------------------------------------------------------

    def run_info(self) -> dict[str, str]:
        """The dtype the engine computes and samples in and its device, read from the
        engine; with mixed precision also the dtype of its masters (``master_dtype``)."""
        info = {"dtype": self.engine.compute_dtype(), "device": str(self.engine.device)}
        if self.engine.config.mixed_precision:
            info["master_dtype"] = self.engine.trained_dtype()
        return info

    def refused_options(self, config: TrainStepConfig) -> dict[str, str]:
        """Every registered loss with every option, every AdamW field, both dtypes and mixed
        precision run here; refused is only a loss that needs inputs a datum does not carry."""
        try:
            loss = build_loss_fn(config.loss_fn, config.loss_fn_config)
        except ValueError as error:
            return {"loss_fn": str(error)}
        missing = sorted(loss.requires - DATUM_INPUTS - {"entropy"})
        if missing:
            return {"loss_fn": f"loss {config.loss_fn!r} needs {', '.join(missing)}, which a remote datum does not carry"}
        return {}

    def train(self, datums: Sequence[RemoteDatum], config: TrainStepConfig) -> dict[str, float]:
        if not datums:
            raise ValueError("train needs at least one datum")
        data = [engine_datum(datum) for datum in datums]

        def step() -> dict[str, float]:
            try:
                backward = self.engine.forward_backward(data, config.loss_fn, dict(config.loss_fn_config))
            except BaseException:
                self.engine.zero_grad()  # a failed pass may have left part of its gradients
                raise
            optimizer = self.engine.optim_step(config.optimizer)
            return {**backward.metrics, **optimizer.metrics}

        return {key: float(value) for key, value in self.compute.call(step).items()}

    def update_sampling_weights(self, weight_path: str | None = None) -> str:
        """Copy the trained weights into the sampler, or load ``weight_path`` (a
        `save_checkpoint` path) into it; returns what sampling now uses."""
        if weight_path is not None:
            self.compute.call(lambda: self.sampler.load_state(weight_path, load_optimizer=False))
            return weight_path
        return self.compute.call(self._publish)

    def _publish(self) -> str:
        with torch.no_grad():
            for target, source in self._published:
                target.copy_(source)
        self._version += 1
        return f"inprocess://sampler/{self._version:06d}"

    def reference_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        return self._scored(self._reference_logprobs, sequences)

    def _scored(
        self, score: Callable[[list[list[int]]], list[list[float | None]]], sequences: Sequence[Sequence[int]]
    ) -> list[list[float]]:
        """``score`` of ``sequences`` on the compute thread, 0.0 at each position 0."""
        if not sequences:
            return []
        rows = self.compute.call(lambda: score([list(tokens) for tokens in sequences]))
        return [[0.0 if value is None else float(value) for value in row] for row in rows]

    def _reference_logprobs(self, sequences: list[list[int]]) -> list[list[float | None]]:
        if self.engine.is_lora:
            with adapters_disabled(self.engine.model):
                return self.engine.compute_logprobs(sequences)
        if self._reference is None:
            logger.info("loading a frozen copy of %s as the KL reference", self.config.model.name)
            self._reference = _frozen_engine(self.engine.config)
        return self._reference.compute_logprobs(sequences)

    def _load_teacher(self, model: str) -> Engine:
        """The frozen teacher, in the student's dtype and device and without adapters.

        :raises ConfigError: naming ``teacher.model`` when it cannot load or its tokenizer
            gives token ids other than the student's.
        """
        logger.info("loading %s as the teacher", model)
        config = attrs.evolve(self.engine.config, model=model, lora=LoraSettings())
        try:
            teacher = _frozen_engine(config)
        except (ValueError, OSError) as error:
            raise ConfigError([f"teacher.model: cannot load {model!r}: {error}"]) from None
        if teacher.tokenizer.get_vocab() != self.engine.tokenizer.get_vocab():
            raise ConfigError([teacher_tokenizer_problem(model, str(self.config.model.name))])
        return teacher

    def teacher_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """The teacher's log-probs of ``sequences`` (`nexrl_core.training.holders.TeacherHolder`).

        :raises ValueError: when the recipe names no teacher.
        """
        teacher = self._teacher
        if teacher is None:
            raise ValueError("this run has no teacher; set teacher.model to score sequences under one")
        return self._scored(teacher.compute_logprobs, sequences)

    # --- checkpoints and shutdown --------------------------------------------------------------

    def save_checkpoint(self, name: str) -> str:
        if not name or name in (".", "..") or "/" in name or "\\" in name:
            raise ValueError(f"a checkpoint name must be a plain file name, got {name!r}")
        path = self.checkpoint_dir / name
        self.compute.call(lambda: self.engine.save_state(path))
        return str(path)

    def load_checkpoint(self, path: str) -> None:
        self.compute.call(lambda: self.engine.load_state(path))

    def export_model(self, directory: Path) -> Path:
        """The sampler's weights (those of the last `update_sampling_weights`) as an HF
        directory: `Engine.export_hf`, LoRA merged and the adapter beside."""
        return self.compute.call(lambda: self.sampler.export_hf(directory))

    def close(self) -> None:
        self.compute.close()
