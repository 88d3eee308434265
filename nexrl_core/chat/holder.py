"""`TemplateChat`: the chat half of every holder that tokenises locally.

A holder samples token ids; rollouts talk in chat messages. Between the two sit the
same few steps whatever runs the model (a Tinker service, an engine in this process):
render the conversation with the model's chat template, stop at the template's
end-of-turn marker when the caller names no stop, and turn the sampled tokens back
into what an OpenAI client returns (visible text without special tokens, tool calls
parsed out). They live here once, so two backends on the same model give the same
prompts, stops and replies.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from nexrl_core.chat.model import SamplingOptions
from nexrl_core.chat.templates import RenderCache, end_of_turn_marker, stop_token_ids
from nexrl_core.chat.toolcalls import parse_tool_calls
from nexrl_core.types import FinishReason, SampleResult

__all__ = ["TemplateChat", "TemplateChatModel"]


class TemplateChat:
    """Chat templates, default stops and replies over a Hugging Face tokenizer.

    ``tokenizer`` and ``renderer`` are called on first use, so a holder whose tokenizer
    comes from a service connects only when a chat method is first called. ``renderer``
    may return a tinker-cookbook style renderer (``build_generation_prompt``,
    ``get_stop_sequences``) that replaces the tokenizer's template, or None.
    """

    def __init__(self, tokenizer: Callable[[], Any], renderer: Callable[[], Any] = lambda: None) -> None:
        self._tokenizer = tokenizer
        self._renderer = renderer
        self._renders = RenderCache()
        self._lock = threading.Lock()
        self._facts: tuple[list[str] | list[int], str | None] | None = None
        """(default stop, end-of-turn marker): both render a probe chat, so once."""

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
    ) -> str | list[int]:
        """`nexrl_core.chat.model.ChatModel.apply_chat_template` with the renderer, else the tokenizer's template."""
        tokenizer = self._tokenizer()
        renderer = self._renderer()
        if renderer is not None:
            if tools or not add_generation_prompt:
                raise ValueError(
                    f"the chat renderer {type(renderer).__name__} only renders generation prompts without tools; "
                    "leave the holder's renderer unset to use the tokenizer's chat template"
                )
            tokens = [int(token) for token in renderer.build_generation_prompt(list(messages)).to_ints()]
            return tokens if tokenize else str(tokenizer.decode(tokens))
        return self._renders.render(tokenizer, messages, tools, add_generation_prompt, tokenize)

    def prompt_tokens(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
        """The token ids an assistant turn is sampled after."""
        prompt = self.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
        assert isinstance(prompt, list)
        return prompt

    def _template_facts(self) -> tuple[list[str] | list[int], str | None]:
        with self._lock:
            if self._facts is None:
                tokenizer = self._tokenizer()
                renderer = self._renderer()
                stop = list(renderer.get_stop_sequences()) if renderer is not None else stop_token_ids(tokenizer)
                self._facts = (stop, end_of_turn_marker(tokenizer))
            return self._facts

    def default_stop(self) -> list[str] | list[int]:
        """What sampling stops at when the caller gives no ``stop``: the end of the assistant's turn."""
        return self._template_facts()[0].copy()

    def visible_text(self, tokens: Sequence[int]) -> str:
        """The reply as a user sees it: special tokens and the end-of-turn marker removed."""
        tokenizer = self._tokenizer()
        text = tokenizer.decode(list(tokens), skip_special_tokens=False)
        marker = self._template_facts()[1]
        if marker and marker in text:
            text = text[: text.index(marker)]
        return str(tokenizer.decode(tokenizer.encode(text, add_special_tokens=False), skip_special_tokens=True))

    def sample_result(
        self, prompt: Sequence[int], tokens: Sequence[int], logprobs: Sequence[float], finish_reason: FinishReason
    ) -> SampleResult:
        """A sampled reply as rollouts receive it, its tool calls parsed into OpenAI format."""
        parsed = parse_tool_calls(self.visible_text(tokens))
        return SampleResult(
            prompt_tokens=[int(token) for token in prompt],
            response_tokens=[int(token) for token in tokens],
            response_logprobs=[float(value) for value in logprobs],
            response_text=parsed.content,
            tool_calls=parsed.tool_calls,
            finish_reason=finish_reason,
        )


class TemplateChatModel:
    """The `nexrl_core.chat.model.ChatModel` methods every model over a `TemplateChat`
    shares: rendering and sampling from messages. A subclass sets ``_chat`` and
    implements `sample_from_prompt`, the one step that differs (a service, an engine, a
    process)."""

    _chat: TemplateChat

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
    ) -> str | list[int]:
        return self._chat.apply_chat_template(messages, tools, add_generation_prompt, tokenize)

    def sample_from_prompt(self, prompt_tokens: Sequence[int], options: SamplingOptions) -> SampleResult:
        raise NotImplementedError(f"{type(self).__name__} must implement sample_from_prompt")

    def sample_from_messages(
        self,
        messages: Sequence[dict[str, Any]],
        options: SamplingOptions,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> SampleResult:
        return self.sample_from_prompt(self._chat.prompt_tokens(messages, tools), options)
