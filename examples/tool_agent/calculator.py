"""A multi-turn agent with a tool: the model may call ``add``, sees its result, answers.

Each turn is one ``llm.chat.completions.create`` call with the tool offered. When the reply
carries tool calls, the agent runs them and appends their results as ``tool`` messages,
OpenAI-style, and asks again; NexRL merges the turns into one trajectory in which the
tool results are context (never trained on) and the model's own tokens are trained. The
reward is exact match of the final answer; ``tool_calls`` counts how often the model used
the tool, and shows up per step in ``metrics.jsonl``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

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
MAX_TURNS = 3


def run_tool(name: str, arguments: str) -> str:
    """The tool's answer, or what was wrong with the call (a model's mistake is an
    observation for it, not an exception for the run)."""
    if name != "add":
        return f"error: unknown tool {name!r}; the only tool is add"
    try:
        values = json.loads(arguments)
        return str(int(values["a"]) + int(values["b"]))
    except (ValueError, KeyError, TypeError) as error:
        return f"error: add takes integer arguments a and b ({error})"


def solve(item: Mapping[str, Any], llm: Any) -> dict[str, float]:
    """Ask for the sum with the tool offered, run any tool calls, and score the final answer."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"What is {item['a']}+{item['b']}? Use the tool."}]
    tool_calls = 0
    for _ in range(MAX_TURNS):
        message = llm.chat.completions.create(messages=messages, tools=TOOLS, max_tokens=32).choices[0].message
        messages.append(message.to_dict())
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            tool_calls += 1
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call.function.name, call.function.arguments)})
    answer = (messages[-1].get("content") or "").strip() if messages[-1]["role"] == "assistant" else ""
    return {"reward": 1.0 if answer == str(int(item["a"]) + int(item["b"])) else 0.0, "tool_calls": float(tool_calls)}
