"""OpenAI-shaped chat completions: what an agent's LLM call returns.

The fields are OpenAI's (``choices[0].message.content``, ``.tool_calls``,
``.finish_reason``, ``usage``), so agent code written for the OpenAI SDK reads them as
it would there; ``completion.nexrl`` adds the `SampleResult` with the exact token ids and
logprobs sampled, which training uses.
"""

from __future__ import annotations

import time
from typing import Any

import attrs

from nexrl_core.types import SampleResult


@attrs.frozen(kw_only=True)
class Function:
    """The function a tool call invokes; ``arguments`` is a JSON string, as in OpenAI's API."""

    name: str
    arguments: str


@attrs.frozen(kw_only=True)
class ChatCompletionMessageToolCall:
    id: str
    function: Function
    type: str = "function"

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": self.type,
            "function": {"name": self.function.name, "arguments": self.function.arguments},
        }


@attrs.frozen(kw_only=True)
class ChatCompletionMessage:
    """The assistant's turn. Append ``message.to_dict()`` to the conversation to continue it."""

    content: str | None
    tool_calls: list[ChatCompletionMessageToolCall] | None = None
    role: str = "assistant"

    def to_dict(self) -> dict[str, Any]:
        """The message as an OpenAI chat message dict (``tool_calls`` only when there are any)."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.to_dict() for call in self.tool_calls]
        return message

    def model_dump(self, **_: Any) -> dict[str, Any]:
        """Alias of `to_dict`, for code written against the ``openai`` package's pydantic objects."""
        return self.to_dict()


@attrs.frozen(kw_only=True)
class Choice:
    index: int
    message: ChatCompletionMessage
    finish_reason: str
    """``stop``, ``length``, or ``tool_calls`` when the model stopped to call tools."""
    logprobs: None = None


@attrs.frozen(kw_only=True)
class CompletionUsage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@attrs.frozen(kw_only=True)
class ChatCompletion:
    """Shaped like ``openai.types.chat.ChatCompletion``, plus the sampled tokens in ``nexrl``."""

    id: str
    choices: list[Choice]
    created: int
    model: str
    usage: CompletionUsage
    nexrl: SampleResult
    """Prompt tokens, response tokens and their sampler logprobs: what training uses."""
    object: str = "chat.completion"


def completion_from_sample(sample: SampleResult, *, completion_id: str, model: str) -> ChatCompletion:
    """Wrap a `SampleResult` as an OpenAI-shaped `ChatCompletion`."""
    tool_calls = [
        ChatCompletionMessageToolCall(
            id=call["id"],
            type=call["type"],
            function=Function(name=call["function"]["name"], arguments=call["function"]["arguments"]),
        )
        for call in sample.tool_calls
    ]
    content: str | None = sample.response_text
    if tool_calls and not sample.response_text.strip():
        content = None
    finish_reason = "tool_calls" if tool_calls and sample.finish_reason == "stop" else sample.finish_reason
    prompt_count, response_count = len(sample.prompt_tokens), len(sample.response_tokens)
    return ChatCompletion(
        id=completion_id,
        choices=[
            Choice(
                index=0,
                message=ChatCompletionMessage(content=content, tool_calls=tool_calls or None),
                finish_reason=finish_reason,
            )
        ],
        created=int(time.time()),
        model=model,
        usage=CompletionUsage(prompt_tokens=prompt_count, completion_tokens=response_count, total_tokens=prompt_count + response_count),
        nexrl=sample,
    )
