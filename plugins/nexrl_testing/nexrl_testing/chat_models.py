"""A `ChatModel` that keeps what it was asked to sample, for tests that check what reached
the model (the prompt a limit let through, the token budget a turn was given) rather than
only what came back: the ``threads`` source's runner and the episode server apply the same
rollout limits, and their tests look at the same record."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nexrl_core.chat.model import ChatModel, SamplingOptions
from nexrl_core.types import SampleResult


class RecordingChatModel:
    """``model`` (a real one: the tests run the shipped tiny model), keeping the prompt
    tokens and options of every sample drawn, in order, in `sampled`."""

    def __init__(self, model: ChatModel) -> None:
        self.model = model
        self.sampled: list[tuple[list[int], SamplingOptions]] = []

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> str | list[int]:
        """The wrapped model's, as it is: rendering samples nothing."""
        return self.model.apply_chat_template(*args, **kwargs)

    def sample_from_prompt(self, prompt_tokens: Sequence[int], options: SamplingOptions) -> SampleResult:
        self.sampled.append((list(prompt_tokens), options))
        return self.model.sample_from_prompt(prompt_tokens, options)

    def sample_from_messages(
        self,
        messages: Sequence[dict[str, Any]],
        options: SamplingOptions,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> SampleResult:
        """Rendered here and sampled through `sample_from_prompt`, so that it is recorded too."""
        prompt = self.apply_chat_template(messages, tools, True, True)
        assert isinstance(prompt, list)
        return self.sample_from_prompt(prompt, options)
