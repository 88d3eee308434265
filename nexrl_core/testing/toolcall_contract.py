"""Contract: a tool call the model really samples comes back in OpenAI's shape.

A small model rarely calls a tool on its own, and a check that never sees a tool call
checks nothing. So `ToolCallContract` first teaches the holder's own model, through the
holder's own training path, to answer one tool-use prompt with a ``<tool_call>`` block
(a few cross-entropy steps on that reply), then samples the prompt with the tool offered
and checks what the holder parsed: ``tool_calls`` in OpenAI format, the arguments as a
JSON string, the call's text out of the visible content, and the finish reason.

Override the ``holder`` fixture with a fresh holder (it is trained). `check_tool_call`
is the check itself, so a test can show that a broken holder fails it.
"""

from __future__ import annotations

import json

import pytest

from nexrl_core.chat.model import SamplingOptions
from nexrl_core.config.adamw import AdamWSettings
from nexrl_core.training.holders import ServiceHolder, TrainStepConfig
from nexrl_core.types import RemoteDatum, SampleResult

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]
MESSAGES = [{"role": "user", "content": "What is 12+7? Use the tool."}]
ARGUMENTS = {"a": 12, "b": 7}
REPLY = '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 7}}</tool_call>'
TEACH = TrainStepConfig(loss_fn="cross_entropy", optimizer=AdamWSettings(learning_rate=3e-3, weight_decay=0.0))
MAX_LESSONS = 100


def reply_datum(holder: ServiceHolder) -> tuple[RemoteDatum, list[int]]:
    """The tool-use prompt followed by `REPLY`, trained on the reply only; and the reply's tokens."""
    prompt = holder.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    full = holder.apply_chat_template(
        [*MESSAGES, {"role": "assistant", "content": REPLY}], tools=TOOLS, add_generation_prompt=False, tokenize=True
    )
    assert isinstance(prompt, list) and isinstance(full, list) and full[: len(prompt)] == prompt
    mask = [0.0] * (len(prompt) - 1) + [1.0] * (len(full) - len(prompt))
    zeros = [0.0] * (len(full) - 1)
    datum = RemoteDatum(input_tokens=full[:-1], target_tokens=full[1:], sampling_logprobs=zeros, advantages=zeros, loss_mask=mask)
    return datum, full[len(prompt) :]


def sample_with_tools(holder: ServiceHolder, max_tokens: int) -> SampleResult:
    return holder.sample_from_messages(MESSAGES, SamplingOptions(max_tokens=max_tokens, temperature=0.0, seed=0), tools=TOOLS)


def teach_tool_call(holder: ServiceHolder) -> SampleResult:
    """Train until the greedy reply to the tool prompt is the taught reply, token for token,
    up to its end of turn; returns that reply. (Stopping at the first reply that parses
    would hand the check a half-learned call, whose arguments depend on float rounding.)"""
    datum, reply = reply_datum(holder)
    for lesson in range(1, MAX_LESSONS + 1):
        holder.train([datum], TEACH)
        if lesson % 5:
            continue
        holder.update_sampling_weights()
        result = sample_with_tools(holder, len(reply) + 4)
        sampled = result.response_tokens
        if result.finish_reason == "stop" and len(sampled) >= len(reply) - 1 and sampled == reply[: len(sampled)]:
            return result
    pytest.fail(f"the greedy reply was not the taught tool call after {MAX_LESSONS} lessons; last reply {result.response_text!r}")


def check_tool_call(result: SampleResult) -> None:
    """The parsed call is OpenAI-shaped, with the arguments as a JSON string."""
    assert len(result.tool_calls) == 1, result.tool_calls
    (call,) = result.tool_calls
    assert call["type"] == "function" and isinstance(call["id"], str) and call["id"]
    assert call["function"]["name"] == "add"
    assert isinstance(call["function"]["arguments"], str), "OpenAI sends arguments as a JSON string"
    assert json.loads(call["function"]["arguments"]) == ARGUMENTS
    assert "<tool_call>" not in result.response_text, "the call's markup must leave the visible text"
    assert result.finish_reason == "stop", "the turn ended at its end-of-turn token"


class ToolCallContract:
    """A really sampled tool call is parsed into OpenAI format; override ``holder`` (fresh)."""

    @pytest.fixture
    def holder(self) -> ServiceHolder:
        raise NotImplementedError("override the 'holder' fixture to return a fresh connected holder")

    @pytest.mark.slow
    def test_a_sampled_tool_call_is_openai_shaped(self, holder: ServiceHolder) -> None:
        check_tool_call(teach_tool_call(holder))
