"""Turning an assistant's raw text into OpenAI-format tool calls.

Chat templates of the Qwen/ChatML family ask the model to emit
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. Holders parse those blocks
so agents get ``message.tool_calls`` exactly as from an OpenAI client. A block whose JSON
does not parse, or lacks a name, is left in the text: a model's mistake is never an
exception, and the agent can see (and the reward can punish) what it wrote.
"""

from __future__ import annotations

import json
import re
from typing import Any

import attrs

TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@attrs.frozen
class ParsedAssistantText:
    """The visible text and the tool calls of one assistant turn."""

    content: str
    tool_calls: list[dict[str, Any]]


def _as_tool_call(payload: str, index: int) -> dict[str, Any] | None:
    try:
        call = json.loads(payload)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    return {
        "id": f"call_{index}",
        "type": "function",
        "function": {
            "name": call["name"],
            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
        },
    }


def parse_tool_calls(text: str) -> ParsedAssistantText:
    """Split ``text`` into content and well-formed tool calls, in order of appearance."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    position = 0
    for match in TOOL_CALL_BLOCK.finditer(text):
        call = _as_tool_call(match.group(1).strip(), len(calls))
        kept.append(text[position : match.start()] if call else text[position : match.end()])
        position = match.end()
        if call:
            calls.append(call)
    kept.append(text[position:])
    content = "".join(kept)
    return ParsedAssistantText(content=content.strip() if calls else content, tool_calls=calls)
