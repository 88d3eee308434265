"""Sampling routes' work: ``create_sampling_session`` and ``asample``.

The Tinker side of sampling: the SDK's bodies (encoded-text prompt chunks, its
sampling parameters, its top-k and target logprob fields, and the options this server
refuses), sampler ids and ``tinker://`` paths, the ``sample_sequence_id`` per sample
that the SDK asserts, and the protobuf response (``prompt_logprobs_last_n`` cuts the
prompt logprobs and the top-k prompt rows there, as the SDK documents, and leaves the
target logprobs whole).

Every logprob returned is of the raw model distribution (temperature 1, no top-k or
top-p filter), the distribution of ``prompt_logprobs`` and of each sampled token's
logprob: the sampling parameters change which tokens are drawn, not these numbers.
Lanes, batching and the engine calls are the runtime's `SamplingOps`; a resubmission
of the same ``(sampling_session_id, seq_id)`` gets the same future.
"""

from __future__ import annotations

from typing import Any

from nexrl_service.runtime import MAX_LOGPROB_CELLS, BadRequest, Outcome, SampleTask, SamplingOps, ServiceState, TrainingOps, new_request_id
from nexrl_tinker.server.codec import (
    PROTO_CONTENT_TYPE,
    TargetPromptIds,
    TopkRows,
    decode_target_prompt_ids,
    encode_sample_response,
)
from nexrl_tinker.server.ids import new_sampler_id, parse_tinker_path
from nexrl_tinker.server.schemas import CreateSamplingSessionBody, SampleBody

__all__ = ["SamplingService"]


def _answer(prompt_length: int, prompt_logprobs: bool, last_n: int | None, request: Any, targets: TargetPromptIds | None) -> Any:
    """The encoder of one request's `PromptSamples`; ``request`` is its `LogprobRequest`."""
    # Positions before the last ``last_n`` are not scored: None, and empty top-k rows.
    cut = prompt_length - last_n if last_n is not None else 1

    def answer(result: Any) -> Outcome:
        logprobs = result.prompt_logprobs if prompt_logprobs else None
        if logprobs is not None:
            logprobs = [None] * cut + list(logprobs[cut:])
        topk_prompt = None
        top, k = result.topk_prompt_logprobs, request.topk_prompt_logprobs
        if top is not None:
            # Engine row t is prompt position t + 1.
            topk_prompt = TopkRows(prompt_length, k, cut, top.token_ids[cut - 1 :], top.logprobs[cut - 1 :])
        k = request.topk_sample_logprobs
        sequence_topk = [
            None if s.topk_logprobs is None else TopkRows(len(s.tokens), k, 0, s.topk_logprobs.token_ids, s.topk_logprobs.logprobs)
            for s in result.sequences
        ]
        target = targets.answer(result.target_prompt_logprobs) if targets is not None else None
        sequences = [(s.tokens, s.logprobs, s.stop_reason) for s in result.sequences]
        body = encode_sample_response(
            sequences, logprobs, sequence_topk=sequence_topk, topk_prompt=topk_prompt, target_prompt_logprobs=target
        )
        return Outcome("done", PROTO_CONTENT_TYPE, body)

    return answer


class SamplingService:
    def __init__(self, state: ServiceState, training: TrainingOps) -> None:
        self.state = state
        self.ops = SamplingOps(state, training)

    # --- sessions -------------------------------------------------------------------------------

    def create_session(self, owner: str, body: CreateSamplingSessionBody) -> dict[str, Any]:
        session = self.state.own_session(owner, body.session_id, active=True)
        existing = self.state.store.sampler_by_seq(session.session_id, body.sampling_session_seq_id)
        if existing is not None:
            return {"type": "create_sampling_session", "sampling_session_id": existing.sampler_id}
        weights, base_weights = None, None
        if body.model_path:
            weights = self.ops.checkpoint_weights(owner, parse_tinker_path(body.model_path).path)
            base_model = weights.base_model
            if body.base_model is not None and self.state.check_base_model(body.base_model) != base_model:
                raise BadRequest(f"{body.model_path!r} was trained from {base_model!r}, not {body.base_model!r}")
        elif body.base_model:
            base_model, base_weights = self.state.sampling_base(body.base_model)
        else:
            raise BadRequest("create_sampling_session needs model_path or base_model")
        sampler = self.ops.create_sampler(
            owner,
            session.session_id,
            body.sampling_session_seq_id,
            new_sampler_id(session.session_id, body.sampling_session_seq_id),
            base_model=base_model,
            weights=weights,
            model_path=body.model_path or None,
            base_weights=base_weights,
        )
        return {"type": "create_sampling_session", "sampling_session_id": sampler.sampler_id}

    def get_sampler(self, owner: str, sampler_id: str) -> dict[str, Any]:
        sampler = self.state.own_sampler(owner, sampler_id)
        return {
            "sampler_id": sampler.sampler_id,
            "base_model": self.state.served_name(sampler.base_model),
            "model_path": sampler.model_path,
        }

    # --- asample --------------------------------------------------------------------------------

    def _task(self, body: SampleBody) -> SampleTask:
        from nexrl_engine.loss_fns import UNSERVED_LOSSES
        from nexrl_engine.types import LogprobRequest, PromptTargets, SamplingParams

        if body.record_stability_info:
            # Recorded only for stable_reinforce; recording nothing while saying yes would
            # let a run fail later, at its first training step, for a reason set here.
            raise BadRequest(
                "record_stability_info is for the 'stable_reinforce' loss, which this server does not serve: "
                f"{UNSERVED_LOSSES['stable_reinforce']}. Create the sampling client without record_stability_info"
            )
        tokens: list[int] = []
        for index, chunk in enumerate(body.prompt.chunks):
            if chunk.type != "encoded_text" or chunk.tokens is None:
                raise BadRequest(
                    f"prompt chunk {index} is {chunk.type!r}; this server runs a text-only model and accepts encoded_text chunks only"
                )
            tokens.extend(chunk.tokens)
        self.ops.check_prompt(tokens, body.num_samples)
        if body.prompt_alt_tokens_k > 0:
            raise BadRequest(
                "prompt_alt_tokens_k is not supported by this server (NexRL TinkerCloud); top-k and target "
                "prompt logprobs are (topk_prompt_logprobs, target_prompt_logprobs)"
            )
        targets = None
        if body.target_prompt_logprobs is not None:
            targets = decode_target_prompt_ids(body.target_prompt_logprobs, len(tokens), self.state.base.vocab_size, MAX_LOGPROB_CELLS)
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
        self.ops.check_stop_tokens(params)
        request = LogprobRequest(
            topk_prompt_logprobs=body.topk_prompt_logprobs,
            target_prompt_logprobs=PromptTargets(*targets.cells()) if targets is not None else None,
            topk_sample_logprobs=body.topk_sample_logprobs,
        )
        self.ops.check_logprob_request(tokens, body.num_samples, params, request)
        answer = _answer(len(tokens), prompt_logprobs, last_n, request, targets)
        return SampleTask(tokens, params, body.num_samples, prompt_logprobs, answer, request)

    def asample(self, owner: str, body: SampleBody) -> dict[str, Any]:
        if body.sampling_session_id is not None:
            sampler = self.state.own_sampler(owner, body.sampling_session_id)
            lane, seq = sampler.sampler_id, body.seq_id
            existing = self.state.book.known(lane, seq)
            if existing is not None:
                return {"request_id": existing.request_id, **(existing.extra or {})}
            ref = self.ops.sampler_weights(sampler)
        elif body.model_path:
            ref = self.ops.checkpoint_weights(owner, parse_tinker_path(body.model_path).path).ref
            lane, seq = f"path:{body.model_path}", None
        elif body.base_model:
            source, ref = self.state.sampling_base(body.base_model)
            lane, seq = ("base" if ref.kind == "base" else f"base:{source}"), None
        else:
            raise BadRequest("asample needs sampling_session_id, model_path or base_model")
        task = self._task(body)
        request_id = new_request_id()
        # Stored with the future so that a deduplicated resubmission answers with the same ids.
        extra = {"sample_sequence_ids": [f"{request_id}:{i}" for i in range(task.num_samples)]}
        row = self.ops.submit(owner, lane, seq, ref, task, request_id=request_id, extra=extra)
        return {"request_id": row.request_id, **(row.extra or {})}
