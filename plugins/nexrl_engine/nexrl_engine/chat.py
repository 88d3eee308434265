"""`EngineChat`: the `nexrl_core.chat.model.ChatModel` half of an in-process engine.

A sampler `Engine` behind one `ComputeThread` (which batches the rollouts' concurrent
sample requests) with `TemplateChat`'s templates, stops and replies. The in-process
holder and the self-hosted backend both sample through it; what differs is where the
sampler's weights come from (the training engine in memory, or the workers' frames).
"""

from __future__ import annotations

from collections.abc import Sequence

from nexrl_core.chat.holder import TemplateChat, TemplateChatModel
from nexrl_core.chat.model import SamplingOptions
from nexrl_core.types import SampleResult
from nexrl_engine.batching import BatchedSamplingOptions
from nexrl_engine.compute import ComputeThread, SampleRequest, plan_call
from nexrl_engine.engine import Engine
from nexrl_engine.types import SampledSequence, SamplingParams

__all__ = ["EngineChat"]


class EngineChat(TemplateChatModel):
    """Samples ``sampler`` for rollouts; every torch call runs on `compute`."""

    def __init__(self, sampler: Engine, options: BatchedSamplingOptions, *, name: str = "nexrl-inprocess-compute") -> None:
        self.sampler = sampler
        self._chat = TemplateChat(lambda: sampler.tokenizer)
        self.compute = ComputeThread(
            self._sample_many,
            linger_s=options.sample_linger_s,
            linger_max_s=options.sample_linger_max_s,
            max_batch_rows=options.max_batch_rows,
            name=name,
        )
        """The one thread every torch call of the owner runs on."""

    @property
    def template_chat(self) -> TemplateChat:
        """Its templates, stops and replies: an owner that is a `TemplateChatModel` over
        this sampler too (`EngineHolder`) renders with the same one."""
        return self._chat

    def sample_from_prompt(self, prompt_tokens: Sequence[int], options: SamplingOptions) -> SampleResult:
        prompt = [int(token) for token in prompt_tokens]
        params = SamplingParams.from_options(options, self._chat.default_stop())
        sequence = self.compute.sample(prompt, params, options.seed)
        return self._chat.sample_result(prompt, sequence.tokens, sequence.logprobs, sequence.stop_reason)

    def _sample_many(self, requests: Sequence[SampleRequest]) -> list[SampledSequence]:
        """One sample per request from the sampler's weights (runs on the compute thread)."""
        samples: list[SampledSequence | None] = [None] * len(requests)
        call = plan_call(requests)
        results = self.sampler.sample(call.prompts, call.params, num_samples=call.counts, seeds=call.seeds)
        for members, result in zip(call.members, results, strict=True):
            for index, sequence in zip(members, result.sequences, strict=True):
                samples[index] = sequence
        assert all(sample is not None for sample in samples)
        return samples  # type: ignore[return-value]

    def close(self) -> None:
        self.compute.close()
