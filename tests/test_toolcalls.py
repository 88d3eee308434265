"""Tool-call blocks become OpenAI tool calls; malformed ones stay text."""

from __future__ import annotations

import json

from nexrl_core.chat.toolcalls import parse_tool_calls


def test_plain_text_has_no_calls() -> None:
    parsed = parse_tool_calls("19")
    assert (parsed.content, parsed.tool_calls) == ("19", [])


def test_well_formed_calls_are_extracted_in_order() -> None:
    text = 'Let me add.\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n<tool_call>{"name": "done"}</tool_call>'
    parsed = parse_tool_calls(text)
    assert parsed.content == "Let me add."
    assert [call["function"]["name"] for call in parsed.tool_calls] == ["add", "done"]
    assert parsed.tool_calls[0] == {
        "id": "call_0",
        "type": "function",
        "function": {"name": "add", "arguments": json.dumps({"a": 1, "b": 2})},
    }
    assert parsed.tool_calls[1]["function"]["arguments"] == "{}"


def test_malformed_json_or_missing_name_stays_text() -> None:
    text = '<tool_call>{"name": "add", "arguments": {</tool_call> and <tool_call>[1, 2]</tool_call>'
    parsed = parse_tool_calls(text)
    assert parsed.tool_calls == []
    assert parsed.content == text


def test_string_arguments_are_kept_verbatim() -> None:
    parsed = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert parsed.tool_calls[0]["function"]["arguments"] == '{"x": 1}'
