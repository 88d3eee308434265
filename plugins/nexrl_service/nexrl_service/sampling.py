"""Sampling sessions and batched sampling, the same for every protocol.

A sampling session is bound at creation to fixed weights: the base model, an exported
``sampler`` checkpoint (an HF directory), a ``training`` checkpoint (state on the
base), or an ephemeral snapshot. Requests run on a FIFO lane per weights (so samplers
of the same weights share one engine and one queue), and consecutive requests whose
parameters differ at most in the seed and the number of samples are batched into one
engine call: RL loops send dozens of single-prompt requests at once, each with its
own seed and sample count. Each request keeps its seed and count in the batch
(`Engine.sample`'s ``seeds`` and per-prompt ``num_samples``), so it samples the same
tokens as it would alone. A protocol decodes a request into a `SampleTask` whose
``answer`` encodes that request's result in the protocol's shape.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from nexrl_service.engines import WeightsRef
from nexrl_service.errors import BadRequest, Gone, RequestFailed
from nexrl_service.futures import Outcome
from nexrl_service.scheduler import Job
from nexrl_service.state import ServiceState
from nexrl_service.store import FutureRow, SamplerRow
from nexrl_service.training import TrainingOps, training_spec_of

__all__ = ["MAX_NUM_SAMPLES", "CheckpointWeights", "SampleTask", "SamplingOps"]

MAX_NUM_SAMPLES = 1024


@attrs.frozen
class SampleTask:
    """One decoded sampling request."""

    prompt: list[int]
    params: Any
    """`nexrl_engine.types.SamplingParams`; its seed is this request's own."""
    num_samples: int
    prompt_logprobs: bool
    answer: Callable[[Any], Outcome] = attrs.field(eq=False)
    """Encodes this request's `PromptSamples` for the protocol."""


@attrs.frozen
class CheckpointWeights:
    """What a checkpoint serves when sampled from."""

    ref: WeightsRef
    base_model: str
    model_id: str
    """The training model that saved it."""


class SamplingOps:
    """Sampling sessions, request checks and batched sampling on the engine pool."""

    def __init__(self, state: ServiceState, training: TrainingOps) -> None:
        self.state = state
        self.training = training

    # --- weights ------------------------------------------------------------------------------

    def checkpoint_weights(self, owner: str, path: str) -> CheckpointWeights:
        """The weights behind the caller's checkpoint ``path``."""
        checkpoint = self.state.own_checkpoint(owner, path)
        source = self.training.source_of(checkpoint)
        if checkpoint.kind in ("sampler", "external"):  # both are HF directories
            ref = WeightsRef("hf", checkpoint.storage_dir)
        else:
            ref = WeightsRef("state", checkpoint.storage_dir, training_spec_of(source))
        return CheckpointWeights(ref, source.base_model, source.model_id)

    def sampler_weights(self, sampler: SamplerRow) -> WeightsRef:
        """The weights a sampling session was bound to."""
        if sampler.weights_kind == "base":
            return WeightsRef("base")
        if sampler.weights_kind == "hf":
            return WeightsRef("hf", sampler.weights_dir)
        source = self.state.store.get_model(sampler.model_id or "")
        if source is None:
            raise RequestFailed(f"the training run behind sampler {sampler.sampler_id!r} no longer exists", "user")
        return WeightsRef("state", sampler.weights_dir, training_spec_of(source))

    # --- sessions -----------------------------------------------------------------------------

    def create_sampler(
        self,
        owner: str,
        session_id: str,
        seq: int,
        sampler_id: str,
        *,
        base_model: str,
        weights: CheckpointWeights | None = None,
        model_path: str | None = None,
    ) -> SamplerRow:
        """Bind sampling session ``sampler_id`` to a checkpoint's weights, or to the base
        model when ``weights`` is None."""
        ref = weights.ref if weights is not None else WeightsRef("base")
        row = SamplerRow(
            sampler_id=sampler_id,
            session_id=session_id,
            seq=seq,
            owner=owner,
            base_model=base_model,
            model_path=model_path,
            model_id=weights.model_id if weights is not None else None,
            weights_kind=ref.kind,
            weights_dir=ref.directory,
            ephemeral=False,
            created_at=time.time(),
        )
        self.state.store.add_sampler(row)
        return row

    # --- requests -----------------------------------------------------------------------------

    def check_prompt(self, tokens: Sequence[int], num_samples: int) -> None:
        """Refuse an empty or out-of-vocabulary prompt, one too long for the model's
        context, or a sample count out of range."""
        base = self.state.base
        if not tokens:
            raise BadRequest("the prompt is empty; it needs at least one token")
        bad = sorted({t for t in tokens if not 0 <= t < base.vocab_size})
        if bad:
            raise BadRequest(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {base.vocab_size})")
        if base.max_context_length and len(tokens) >= base.max_context_length:
            raise BadRequest(f"the prompt has {len(tokens)} tokens; the model's context is {base.max_context_length}")
        if not 1 <= num_samples <= MAX_NUM_SAMPLES:
            raise BadRequest(f"num_samples must be between 1 and {MAX_NUM_SAMPLES}, got {num_samples}")

    def check_stop_tokens(self, params: Any) -> None:
        """Refuse stop token ids outside the vocabulary (stop strings are not checked)."""
        vocab_size = self.state.base.vocab_size
        if params.stop and not isinstance(params.stop[0], str):
            bad_stop = [t for t in params.stop if not 0 <= int(t) < vocab_size]
            if bad_stop:
                raise BadRequest(f"stop token ids {bad_stop} are outside the vocabulary [0, {vocab_size})")

    def submit(
        self,
        owner: str,
        lane: str,
        seq: int | None,
        ref: WeightsRef,
        task: SampleTask,
        *,
        request_id: str,
        extra: dict[str, Any] | None = None,
    ) -> FutureRow:
        """Record the future (deduplicated on ``(lane, seq)``) and queue the task on the
        FIFO lane of its weights; ``extra`` is echoed to a deduplicated resubmission."""
        if ref.directory is not None and not Path(ref.directory).is_dir():
            raise Gone(f"the weights behind this sampler were deleted (checkpoint expired or deleted): {ref.directory}")
        row, is_new = self.state.book.create(owner, lane, seq, "Sample", extra=extra, request_id=request_id)
        if is_new:
            # Requests on the same weights batch into one decode loop whatever they sample
            # with (each row keeps its own params, seed and count); only whether prompt
            # logprobs are wanted must match, since the prefill computes them for all.
            key = task.prompt_logprobs
            job = Job(
                row.request_id,
                lambda: self._run([task], ref)[0],
                batch_key=key,
                run_batch=lambda jobs: self._run([j.payload for j in jobs], ref),
                payload=task,
                rows=task.num_samples,
            )
            self.state.scheduler.submit_fifo(f"weights:{ref.key}", job)
        return row

    def _run(self, tasks: Sequence[SampleTask], ref: WeightsRef) -> list[Outcome]:
        engine = self.state.engines.sampler(ref)
        results = engine.sample(
            [task.prompt for task in tasks],
            [attrs.evolve(task.params, seed=None) for task in tasks],
            num_samples=[task.num_samples for task in tasks],
            include_prompt_logprobs=tasks[0].prompt_logprobs,
            seeds=[task.params.seed for task in tasks],
        )
        return [task.answer(result) for task, result in zip(tasks, results)]
