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

A request may also ask for top-k logprobs at prompt and sampled positions and for chosen
ids' logprobs at prompt positions (`nexrl_engine.types.LogprobRequest`); they come from
the same prefill and decode steps, within the bounds below.
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

__all__ = ["MAX_LOGPROB_CELLS", "MAX_NUM_SAMPLES", "MAX_TOPK_LOGPROBS", "CheckpointWeights", "SampleTask", "SamplingOps"]

MAX_NUM_SAMPLES = 1024
MAX_TOPK_LOGPROBS = 128
"""Widest top-k a request may ask for, at prompt or sampled positions: six times the
cookbook's distillation default (20), and a bound on the per-position work."""
MAX_LOGPROB_CELLS = 1 << 22
"""Most top-k or target logprobs one field of a request may ask for in all (positions
times k, samples included): about 32 MB of ids and logprobs to hold and send."""


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
    logprobs: Any = None
    """`nexrl_engine.types.LogprobRequest`: top-k and target logprobs (None: none)."""

    @property
    def scores_prompt(self) -> bool:
        """Whether the prefill keeps every prompt position's logits for this request."""
        return self.prompt_logprobs or (self.logprobs is not None and self.logprobs.scores_prompt)


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
        """The weights behind checkpoint ``path``: the caller's own or a published one."""
        checkpoint = self.state.own_checkpoint(owner, path, public_ok=True)
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
        base_weights: WeightsRef | None = None,
    ) -> SamplerRow:
        """Bind sampling session ``sampler_id`` to a checkpoint's weights, or when
        ``weights`` is None to ``base_weights`` (`ServiceState.sampling_base`; default:
        the served model's)."""
        ref = weights.ref if weights is not None else base_weights or WeightsRef("base")
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

    def check_logprob_request(self, tokens: Sequence[int], num_samples: int, params: Any, request: Any) -> None:
        """Refuse a top-k width that is not from 0 to `MAX_TOPK_LOGPROBS` (and the
        vocabulary size), and top-k fields that would hold more than `MAX_LOGPROB_CELLS`
        logprobs (prompt positions times k; samples times new tokens times k). ``request``
        is a `nexrl_engine.types.LogprobRequest` whose target cells the protocol checked."""
        vocab_size = self.state.base.vocab_size
        widest = min(MAX_TOPK_LOGPROBS, vocab_size)
        for name in ("topk_prompt_logprobs", "topk_sample_logprobs"):
            k = getattr(request, name)
            if not 0 <= k <= widest:
                raise BadRequest(f"{name} must be from 0 to {widest} (the most this server returns per position), got {k}")
        prompt_cells = len(tokens) * request.topk_prompt_logprobs
        if prompt_cells > MAX_LOGPROB_CELLS:
            raise BadRequest(
                f"topk_prompt_logprobs={request.topk_prompt_logprobs} on a {len(tokens)}-token prompt asks for {prompt_cells} "
                f"logprobs; at most {MAX_LOGPROB_CELLS} per request: lower k or split the prompt"
            )
        context = self.state.base.max_context_length
        room = [n for n in (params.max_tokens, context - len(tokens) if context else None) if n is not None]
        if room and request.topk_sample_logprobs:
            sample_cells = num_samples * min(room) * request.topk_sample_logprobs
            if sample_cells > MAX_LOGPROB_CELLS:
                raise BadRequest(
                    f"topk_sample_logprobs={request.topk_sample_logprobs} for {num_samples} samples of up to {min(room)} tokens "
                    f"asks for {sample_cells} logprobs; at most {MAX_LOGPROB_CELLS} per request: lower k, num_samples or max_tokens"
                )

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
            # with (each row keeps its own params, seed, count and top-k); whether prompt
            # logprobs are wanted must match, since the prefill computes them for all, and
            # a request that scores prompt positions does not make others' prefill keep
            # every position's logits.
            key = (task.prompt_logprobs, task.scores_prompt)
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
            logprobs=[task.logprobs for task in tasks],
        )
        return [task.answer(result) for task, result in zip(tasks, results)]
