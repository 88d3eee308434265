"""What rollouts sample from: a chat model with token ids and logprobs.

Every backend hands rollouts one `ChatModel`; a service holder is one, and so is an
engine running in the training process. Agents never see it directly: they talk to
the OpenAI-shaped client of `nexrl_core.run.rollout`, which calls it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import attrs

from nexrl_core.types import SampleResult


@attrs.frozen(kw_only=True)
class SamplingOptions:
    """How one completion is sampled."""

    max_tokens: int = attrs.field(default=64, validator=attrs.validators.gt(0))
    temperature: float = attrs.field(default=1.0, validator=attrs.validators.ge(0))
    top_p: float = attrs.field(default=1.0, validator=[attrs.validators.gt(0), attrs.validators.le(1)])
    top_k: int = -1
    """-1 disables top-k."""
    stop: Sequence[str] | Sequence[int] | None = None
    """Stop strings or token ids; None uses the chat template's end-of-turn markers."""
    seed: int | None = None


class ChatModel(Protocol):
    """The policy as rollouts see it: chat templates and sampling with token ids and logprobs."""

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
    ) -> str | list[int]:
        """Render chat messages with the model's template; token ids when ``tokenize``."""
        ...

    def sample_from_prompt(self, prompt_tokens: Sequence[int], options: SamplingOptions) -> SampleResult:
        """Sample one completion of a tokenised prompt."""
        ...

    def sample_from_messages(
        self,
        messages: Sequence[dict[str, Any]],
        options: SamplingOptions,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> SampleResult:
        """Render ``messages`` (and ``tools``), sample one assistant turn, parse its tool calls."""
        ...
