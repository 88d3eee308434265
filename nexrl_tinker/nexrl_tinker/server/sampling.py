"""Sampling sessions and ``asample``.

A sampling session is bound at creation to fixed weights: the base model, a
``sampler_weights`` checkpoint (an exported HF directory), a ``weights`` checkpoint
(training state on the base), or an ephemeral snapshot. Requests run on a FIFO lane
per weights (so samplers of the same weights share one engine and one queue), and
consecutive requests whose parameters differ at most in the seed (and the number of
samples) are batched into one
engine call: the RL loops send dozens of single-prompt requests at once, each with its
own seed and sample count. Each request keeps its seed and count in the batch
(`Engine.sample`'s ``seeds`` and per-prompt ``num_samples``), so it samples the same
tokens as it would alone.

The asample future carries one ``sample_sequence_id`` per sample (the SDK asserts it),
and a resubmission of the same ``(sampling_session_id, seq_id)`` gets the same future.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from nexrl_tinker.server.cloud import Cloud, training_spec_of
from nexrl_tinker.server.codec import PROTO_CONTENT_TYPE, encode_sample_response
from nexrl_tinker.server.engines import WeightsRef
from nexrl_tinker.server.errors import BadRequest, Gone
from nexrl_tinker.server.futures import Outcome
from nexrl_tinker.server.ids import new_request_id, new_sampler_id, parse_tinker_path
from nexrl_tinker.server.scheduler import Job
from nexrl_tinker.server.schemas import CreateSamplingSessionBody, SampleBody
from nexrl_tinker.server.store import SamplerRow
from nexrl_tinker.server.training import TrainingService

__all__ = ["SamplingService"]

MAX_NUM_SAMPLES = 1024


@attrs.frozen
class SampleTask:
    prompt: list[int]
    params: Any
    num_samples: int
    prompt_logprobs: bool
    last_n: int | None


class SamplingService:
    def __init__(self, cloud: Cloud, training: TrainingService) -> None:
        self.cloud = cloud
        self.training = training

    # --- sessions -------------------------------------------------------------------------------

    def _weights_of_path(self, owner: str, model_path: str) -> tuple[str, str, str, str | None]:
        """``(weights_kind, directory, base_model, model_id)`` of a checkpoint path."""
        parsed = parse_tinker_path(model_path)
        checkpoint = self.cloud.own_checkpoint(owner, parsed.path)
        source = self.cloud.store.get_model(checkpoint.model_id)
        if source is None:
            raise BadRequest(f"the training run that saved {model_path!r} no longer exists")
        kind = "hf" if checkpoint.kind == "sampler" else "state"
        return kind, checkpoint.storage_dir, source.base_model, source.model_id

    def create_session(self, owner: str, body: CreateSamplingSessionBody) -> dict[str, Any]:
        session = self.cloud.own_session(owner, body.session_id, active=True)
        existing = self.cloud.store.sampler_by_seq(session.session_id, body.sampling_session_seq_id)
        if existing is not None:
            return {"type": "create_sampling_session", "sampling_session_id": existing.sampler_id}
        if body.model_path:
            kind, directory, base_model, model_id = self._weights_of_path(owner, body.model_path)
            if body.base_model is not None and self.cloud.check_base_model(body.base_model) != base_model:
                raise BadRequest(f"{body.model_path!r} was trained from {base_model!r}, not {body.base_model!r}")
        elif body.base_model:
            kind, directory, base_model, model_id = "base", None, self.cloud.check_base_model(body.base_model), None
        else:
            raise BadRequest("create_sampling_session needs model_path or base_model")
        sampler_id = new_sampler_id(session.session_id, body.sampling_session_seq_id)
        self.cloud.store.add_sampler(
            SamplerRow(
                sampler_id=sampler_id,
                session_id=session.session_id,
                seq=body.sampling_session_seq_id,
                owner=owner,
                base_model=base_model,
                model_path=body.model_path or None,
                model_id=model_id,
                weights_kind=kind,
                weights_dir=directory,
                ephemeral=False,
                created_at=time.time(),
            )
        )
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    def get_sampler(self, owner: str, sampler_id: str) -> dict[str, Any]:
        sampler = self.cloud.own_sampler(owner, sampler_id)
        return {"sampler_id": sampler.sampler_id, "base_model": sampler.base_model, "model_path": sampler.model_path}

    # --- asample --------------------------------------------------------------------------------

    def _task(self, body: SampleBody) -> SampleTask:
        from nexrl_fsdp.types import SamplingParams

        tokens: list[int] = []
        for index, chunk in enumerate(body.prompt.chunks):
            if chunk.type != "encoded_text" or chunk.tokens is None:
                raise BadRequest(
                    f"prompt chunk {index} is {chunk.type!r}; this server runs a text-only model and accepts "
                    f"encoded_text chunks only"
                )
            tokens.extend(chunk.tokens)
        base = self.cloud.base
        if not tokens:
            raise BadRequest("the prompt is empty; it needs at least one token")
        bad = sorted({t for t in tokens if not 0 <= t < base.vocab_size})
        if bad:
            raise BadRequest(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {base.vocab_size})")
        if base.max_context_length and len(tokens) >= base.max_context_length:
            raise BadRequest(f"the prompt has {len(tokens)} tokens; the model's context is {base.max_context_length}")
        if not 1 <= body.num_samples <= MAX_NUM_SAMPLES:
            raise BadRequest(f"num_samples must be between 1 and {MAX_NUM_SAMPLES}, got {body.num_samples}")
        unsupported = [
            name
            for name, asked in (
                ("topk_prompt_logprobs", body.topk_prompt_logprobs > 0),
                ("topk_sample_logprobs", body.topk_sample_logprobs > 0),
                ("prompt_alt_tokens_k", body.prompt_alt_tokens_k > 0),
                ("target_prompt_logprobs", body.target_prompt_logprobs is not None),
            )
            if asked
        ]
        if unsupported:
            raise BadRequest(f"{', '.join(unsupported)} is not supported by this server (NexRL TinkerCloud)")
        prompt_logprobs = bool(body.prompt_logprobs)
        last_n = body.prompt_logprobs_last_n
        if last_n is not None:
            if not prompt_logprobs:
                raise BadRequest("prompt_logprobs_last_n needs prompt_logprobs=true")
            if not 1 <= last_n <= len(tokens) - 1:
                raise BadRequest(f"prompt_logprobs_last_n must be between 1 and len(prompt) - 1 = {len(tokens) - 1}")
        p = body.sampling_params
        try:
            params = SamplingParams(
                max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, stop=p.stop, seed=p.seed
            )
        except (TypeError, ValueError) as exc:
            raise BadRequest(f"invalid sampling_params: {exc}") from None
        if params.stop and not isinstance(params.stop[0], str):
            bad_stop = [t for t in params.stop if not 0 <= int(t) < base.vocab_size]
            if bad_stop:
                raise BadRequest(f"stop token ids {bad_stop} are outside the vocabulary [0, {base.vocab_size})")
        return SampleTask(tokens, params, body.num_samples, prompt_logprobs, last_n)

    def asample(self, owner: str, body: SampleBody) -> dict[str, Any]:
        if body.sampling_session_id is not None:
            sampler = self.cloud.own_sampler(owner, body.sampling_session_id)
            lane, seq = sampler.sampler_id, body.seq_id
            existing = self.cloud.book.known(lane, seq)
            if existing is not None:
                return {"request_id": existing.request_id, **(existing.extra or {})}
            ref = self.training.weights_ref_of_sampler(sampler)
        elif body.model_path:
            kind, directory, _, model_id = self._weights_of_path(owner, body.model_path)
            source = self.cloud.store.get_model(model_id or "")
            ref = WeightsRef(kind, directory, training_spec_of(source) if kind == "state" and source else None)
            lane, seq = f"path:{body.model_path}", None
        elif body.base_model:
            self.cloud.check_base_model(body.base_model)
            ref, lane, seq = WeightsRef("base"), "base", None
        else:
            raise BadRequest("asample needs sampling_session_id, model_path or base_model")
        if ref.directory is not None and not Path(ref.directory).is_dir():
            raise Gone(f"the weights behind this sampler were deleted (checkpoint expired or deleted): {ref.directory}")
        task = self._task(body)
        request_id = new_request_id()
        ids = [f"{request_id}:{i}" for i in range(task.num_samples)]
        # Stored with the future so that a deduplicated resubmission answers with the same ids.
        row, is_new = self.cloud.book.create(
            owner, lane, seq, "Sample", extra={"sample_sequence_ids": ids}, request_id=request_id
        )
        if is_new:
            # Everything but the seed and the sample count must match: each request's seed
            # and count go into the batch.
            key = (attrs.astuple(attrs.evolve(task.params, seed=None)), task.prompt_logprobs)
            job = Job(
                row.request_id,
                lambda: self._run([task], ref)[0],
                batch_key=key,
                run_batch=lambda jobs: self._run([j.payload for j in jobs], ref),
                payload=task,
                rows=task.num_samples,
            )
            self.cloud.scheduler.submit_fifo(f"weights:{ref.key}", job)
        return {"request_id": row.request_id, **(row.extra or {})}

    def _run(self, tasks: Sequence[SampleTask], ref: WeightsRef) -> list[Outcome]:
        engine = self.cloud.engines.sampler(ref)
        first = tasks[0]
        results = engine.sample(
            [task.prompt for task in tasks],
            attrs.evolve(first.params, seed=None),
            num_samples=[task.num_samples for task in tasks],
            include_prompt_logprobs=first.prompt_logprobs,
            seeds=[task.params.seed for task in tasks],
        )
        outcomes = []
        for task, result in zip(tasks, results):
            prompt_logprobs = result.prompt_logprobs if task.prompt_logprobs else None
            if prompt_logprobs is not None and task.last_n is not None:
                cut = len(prompt_logprobs) - task.last_n
                prompt_logprobs = [None] * cut + list(prompt_logprobs[cut:])
            sequences = [(s.tokens, s.logprobs, s.stop_reason) for s in result.sequences]
            outcomes.append(Outcome("done", PROTO_CONTENT_TYPE, encode_sample_response(sequences, prompt_logprobs)))
        return outcomes
