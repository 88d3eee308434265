"""Sampling routes' work: sampling sessions, samples and prompt logprobs.

The Weaver side of sampling: the SDK's bodies (encoded-text prompt chunks, its
sampling parameters with stop strings and stop token ids apart, and the options this
server refuses), ``weaver://`` model paths, and the response the SDK reads:
``{"result": {"sequences": [{tokens, logprobs, stop_reason, text}]}}`` with the text
decoded here, so the client never needs a tokenizer to sample. Lanes, batching and
the engine calls are the runtime's `SamplingOps`.
"""

from __future__ import annotations

import threading
from typing import Any

from nexrl_service.runtime import (
    BadRequest,
    Outcome,
    SamplerRow,
    SampleTask,
    SamplingOps,
    ServiceState,
    TrainingOps,
    WeightsRef,
    new_request_id,
)
from nexrl_weaver.server import operations
from nexrl_weaver.server.bodies import flag, number, obj, optional_int, optional_str
from nexrl_weaver.server.ids import new_id, parse_weaver_path
from nexrl_weaver.server.training import split_context_suffix

__all__ = ["WeaverSampling"]

UNSUPPORTED_FLAGS = ("return_sampling_mask", "return_old_logprob", "return_moe_topk_indices")


class WeaverSampling:
    def __init__(self, state: ServiceState, training: TrainingOps) -> None:
        self.state = state
        self.ops = SamplingOps(state, training)
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    def _decode(self, tokens: list[int]) -> str:
        with self._lock:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(str(self.state.base.directory))
        return str(self._tokenizer.decode(tokens, skip_special_tokens=False))

    # --- sessions -------------------------------------------------------------------------------

    def session_json(self, sampler: SamplerRow) -> dict[str, Any]:
        return {
            "id": sampler.sampler_id,
            "session_id": sampler.session_id,
            "base_model": self.state.base.name,
            "model_path": sampler.model_path,
            "model_id": sampler.model_id,
            "tokenizer_path": str(self.state.base.directory),
        }

    def create_session(self, owner: str, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        session = self.state.own_session(owner, session_id, active=True)
        seq = optional_int(body, "sampling_session_seq_id", minimum=0)
        if seq is not None:
            existing = self.state.store.sampler_by_seq(session.session_id, seq)
            if existing is not None:  # a re-sent create
                return self.session_json(existing)
        model_path, base_model = optional_str(body, "model_path"), optional_str(body, "base_model")
        model_id = optional_str(body, "model_id")
        weights = None
        if model_path:
            weights = self.ops.checkpoint_weights(owner, parse_weaver_path(model_path).path)
            if model_id is not None and model_id != weights.model_id:
                raise BadRequest(f"model_path {model_path!r} was saved by model {weights.model_id!r}, not {model_id!r}")
            base = weights.base_model
            if base_model is not None and self.state.check_base_model(split_context_suffix(base_model)) != base:
                raise BadRequest(f"{model_path!r} was trained from {base!r}, not {base_model!r}")
        elif model_id:
            raise BadRequest("model_path is required when model_id is given")
        elif base_model:
            base = self.state.check_base_model(split_context_suffix(base_model))
        else:
            raise BadRequest("a sampling session needs model_path or base_model")
        if seq is None:
            seq = len(self.state.store.samplers_of_session(session.session_id)) + 1_000_000
        sampler = self.ops.create_sampler(owner, session.session_id, seq, new_id(), base_model=base, weights=weights, model_path=model_path)
        return self.session_json(sampler)

    def get_session(self, owner: str, sampler_id: str) -> dict[str, Any]:
        return self.session_json(self.state.own_sampler(owner, sampler_id))

    def delete_session(self, owner: str, sampler_id: str) -> dict[str, Any]:
        sampler = self.state.own_sampler(owner, sampler_id)
        self.state.store.delete_samplers([sampler.sampler_id])
        return {"id": sampler.sampler_id, "deleted": True}

    # --- requests -------------------------------------------------------------------------------

    def _prompt(self, body: dict[str, Any], num_samples: int) -> list[int]:
        prompt = obj(body.get("prompt"), "body.prompt")
        chunks = prompt.get("chunks")
        if not isinstance(chunks, list) or not chunks:
            raise BadRequest("body.prompt.chunks must be a non-empty list of {type: encoded_text, tokens}")
        tokens: list[int] = []
        for index, chunk in enumerate(chunks):
            chunk = obj(chunk, f"body.prompt.chunks[{index}]")
            values = chunk.get("tokens")
            if chunk.get("type", "encoded_text") != "encoded_text" or not isinstance(values, list):
                raise BadRequest(f"body.prompt.chunks[{index}] must be an encoded_text chunk with a tokens list")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in values):
                raise BadRequest(f"body.prompt.chunks[{index}].tokens must be integers")
            tokens.extend(values)
        self.ops.check_prompt(tokens, num_samples)
        return tokens

    def _weights(self, owner: str, sampler_id: str) -> tuple[SamplerRow, WeightsRef]:
        sampler = self.state.own_sampler(owner, sampler_id)
        return sampler, self.ops.sampler_weights(sampler)

    def sample(self, owner: str, sampler_id: str, body: dict[str, Any]) -> str:
        from nexrl_engine.types import SamplingParams

        sampler, ref = self._weights(owner, sampler_id)
        num_samples = optional_int(body, "num_samples", minimum=1) or 1
        tokens = self._prompt(body, num_samples)
        refused = [name for name in UNSUPPORTED_FLAGS if flag(body, name)]
        if optional_int(body, "topk_prompt_logprobs", minimum=0):
            refused.append("topk_prompt_logprobs")
        if body.get("score_centering") is not None:
            refused.append("score_centering")
        if refused:
            raise BadRequest(f"{', '.join(refused)} is not supported by this server (NexRL's local Weaver service)")
        prompt_logprobs = flag(body, "prompt_logprobs")
        p = obj(body.get("sampling_params"), "body.sampling_params")
        stop_strings, stop_ids = p.get("stop") or [], p.get("stop_token_ids") or []
        if stop_strings and stop_ids:
            raise BadRequest("this server stops on strings or on token ids, not both in one request; send one kind")
        seed = optional_int(p, "seed", "body.sampling_params")
        if seed is None:
            seed = optional_int(p, "sampling_seed", "body.sampling_params")
        try:
            params = SamplingParams(
                max_tokens=optional_int(p, "max_tokens", "body.sampling_params", 1),
                temperature=number(p, "temperature", "body.sampling_params", 1.0),
                top_p=number(p, "top_p", "body.sampling_params", 1.0),
                top_k=-1 if (top_k := optional_int(p, "top_k", "body.sampling_params")) is None else top_k,
                stop=stop_strings or stop_ids or None,
                seed=seed,
            )
        except (TypeError, ValueError) as exc:
            raise BadRequest(f"invalid body.sampling_params: {exc}") from None
        self.ops.check_stop_tokens(params)

        def answer(result: Any) -> Outcome:
            sequences = [
                {
                    "tokens": list(s.tokens),
                    "logprobs": list(s.logprobs),
                    "stop_reason": s.stop_reason,
                    "text": self._decode(list(s.tokens)),
                }
                for s in result.sequences
            ]
            response: dict[str, Any] = {"sequences": sequences}
            if prompt_logprobs:
                response["prompt_logprobs"] = result.prompt_logprobs
            return operations.done({"result": response})

        task = SampleTask(tokens, params, num_samples, prompt_logprobs, answer)
        row = self.ops.submit(owner, sampler.sampler_id, None, ref, task, request_id=new_request_id())
        return row.request_id

    def logprobs(self, owner: str, sampler_id: str, body: dict[str, Any]) -> str:
        from nexrl_engine.types import SamplingParams

        sampler, ref = self._weights(owner, sampler_id)
        tokens = self._prompt(body, 1)
        if flag(body, "return_rollout_token_expert"):
            raise BadRequest("return_rollout_token_expert is not supported by this server (a dense model)")
        if obj(body.get("loss_fn_config"), "body.loss_fn_config"):
            raise BadRequest("loss_fn_config is not supported for compute_logprobs by this server")

        def answer(result: Any) -> Outcome:
            return operations.done({"result": {"prompt_logprobs": result.prompt_logprobs}})

        # Prompt logprobs come with a sample; one greedy token is the cheapest.
        task = SampleTask(tokens, SamplingParams(max_tokens=1, temperature=0.0, seed=0), 1, True, answer)
        row = self.ops.submit(owner, sampler.sampler_id, None, ref, task, request_id=new_request_id())
        return row.request_id
