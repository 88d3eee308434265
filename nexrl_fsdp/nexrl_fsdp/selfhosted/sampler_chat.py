"""`SamplerChat`: the `nexrl_core.chat_model.ChatModel` rollouts of a self-hosted run use.

Templates, default stops, tool calls and replies are `TemplateChat` over the model's
tokenizer loaded here in the driver; only token ids cross to the sampler process
(`SamplerProcess`), which draws the tokens. A prompt's default stop is resolved here,
so the process always gets an explicit one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nexrl_core.chat_holder import TemplateChat
from nexrl_core.chat_model import SamplingOptions
from nexrl_core.types import SampleResult
from nexrl_fsdp.selfhosted.sampler_process import SamplerProcess
from nexrl_fsdp.types import SamplingParams

__all__ = ["SamplerChat"]


class SamplerChat:
    """Samples from the sampler process; thread-safe (one socket per calling thread)."""

    def __init__(self, process: SamplerProcess, tokenizer: Any) -> None:
        self.process = process
        self._chat = TemplateChat(lambda: tokenizer)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
    ) -> str | list[int]:
        return self._chat.apply_chat_template(messages, tools, add_generation_prompt, tokenize)

    def sample_from_prompt(self, prompt_tokens: Sequence[int], options: SamplingOptions) -> SampleResult:
        prompt = [int(token) for token in prompt_tokens]
        stop = options.stop if options.stop is not None else self._chat.default_stop()
        # Checked here, so bad options fail in the caller's thread with the engine's message.
        params = SamplingParams(max_tokens=options.max_tokens, temperature=options.temperature, top_p=options.top_p, top_k=options.top_k, stop=stop)
        header = {
            "kind": "sample",
            "prompt": prompt,
            "params": {"max_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p,
                       "top_k": params.top_k, "stop": list(params.stop) if params.stop is not None else None},
            "seed": options.seed,
        }
        reply = self.process.request(header).header
        return self._chat.sample_result(prompt, reply["tokens"], reply["logprobs"], reply["stop_reason"])

    def sample_from_messages(
        self,
        messages: Sequence[dict[str, Any]],
        options: SamplingOptions,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> SampleResult:
        return self.sample_from_prompt(self._chat.prompt_tokens(messages, tools), options)
