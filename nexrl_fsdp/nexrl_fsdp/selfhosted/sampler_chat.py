"""`SamplerChat`: the `nexrl_core.chat.model.ChatModel` rollouts of a self-hosted run use.

Templates, default stops, tool calls and replies are `TemplateChat` over the model's
tokenizer loaded here in the driver; only token ids cross to the sampler process
(`SamplerProcess`), which draws the tokens. A prompt's default stop is resolved here,
so the process always gets an explicit one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from nexrl_core.chat.holder import TemplateChat, TemplateChatModel
from nexrl_core.chat.model import SamplingOptions
from nexrl_core.types import SampleResult
from nexrl_engine.types import SamplingParams
from nexrl_fsdp.selfhosted.sampler_process import SamplerProcess

__all__ = ["SamplerChat"]


class SamplerChat(TemplateChatModel):
    """Samples from the sampler process; thread-safe (one socket per calling thread)."""

    def __init__(self, process: SamplerProcess, tokenizer: Any) -> None:
        self.process = process
        self._chat = TemplateChat(lambda: tokenizer)

    def sample_from_prompt(self, prompt_tokens: Sequence[int], options: SamplingOptions) -> SampleResult:
        prompt = [int(token) for token in prompt_tokens]
        # Built here, so bad options fail in the caller's thread with the engine's message.
        params = SamplingParams.from_options(options, self._chat.default_stop())
        header = {"kind": "sample", "prompt": prompt, "params": attrs.asdict(params), "seed": options.seed}
        reply = self.process.request(header).header
        return self._chat.sample_result(prompt, reply["tokens"], reply["logprobs"], reply["stop_reason"])
