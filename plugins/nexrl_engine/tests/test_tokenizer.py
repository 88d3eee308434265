"""The shipped tokenizer: offline reload, special tokens, digits, and the chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from nexrl_engine.loading import shipped_model_dir
from nexrl_engine.tiny.tokenizer import build_tokenizer, training_corpus

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Lima?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'}},
        ],
    },
    {"role": "tool", "content": "sunny"},
    {"role": "tool", "content": "rain"},
    {"role": "user", "content": "Thanks!"},
]


@pytest.fixture(scope="module")
def tokenizer(monkeypatch_module: pytest.MonkeyPatch) -> object:
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch_module.setenv("TRANSFORMERS_OFFLINE", "1")
    return AutoTokenizer.from_pretrained(str(shipped_model_dir("nexrl-tiny")), local_files_only=True)


@pytest.fixture(scope="module")
def monkeypatch_module() -> pytest.MonkeyPatch:
    patch = pytest.MonkeyPatch()
    yield patch
    patch.undo()


def test_special_tokens(tokenizer) -> None:
    assert len(tokenizer) == 1024
    assert tokenizer.convert_tokens_to_ids("<|endoftext|>") == 0 == tokenizer.pad_token_id
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2 == tokenizer.eos_token_id
    for token in ("<tool_call>", "</tool_call>"):
        ids = tokenizer.encode(token, add_special_tokens=False)
        assert len(ids) == 1 and tokenizer.convert_ids_to_tokens(ids) == [token]


def test_digits_are_single_tokens(tokenizer) -> None:
    for text in ("137", "a 2026 b", "12+7="):
        pieces = tokenizer.convert_ids_to_tokens(tokenizer.encode(text, add_special_tokens=False))
        digits = [p for p in pieces if any(ch.isdigit() for ch in p)]
        assert all(len(p) == 1 for p in digits), pieces
    assert tokenizer.decode(tokenizer.encode("Hello, world: 42!", add_special_tokens=False)) == "Hello, world: 42!"


def test_chat_template_with_tools(tokenizer) -> None:
    text = tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    tools_block = text[text.index("<tools>\n") + len("<tools>\n") : text.index("\n</tools>")]
    assert json.loads(tools_block) == TOOLS[0]
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Lima"}}</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert tokenizer.decode(ids) == text
    assert ids.count(1) == text.count("<|im_start|>")


def test_chat_template_plain(tokenizer) -> None:
    text = tokenizer.apply_chat_template([{"role": "user", "content": "12+7="}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\n12+7=<|im_end|>\n<|im_start|>assistant\n"
    reply = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert tokenizer.apply_chat_template(reply, tokenize=False).endswith("<|im_start|>assistant\nhello<|im_end|>\n")


def test_tool_call_markers_survive_skip_special(tokenizer) -> None:
    ids = tokenizer.encode('<tool_call>{"name": "x"}</tool_call><|im_end|>', add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == '<tool_call>{"name": "x"}</tool_call>'


def test_rebuilt_tokenizer_is_identical(tokenizer, tmp_path: Path) -> None:
    """A rebuild gives the same files, and it tokenizes exactly like the shipped one
    (which transformers reloads as a Qwen2Tokenizer because of the model's config)."""
    built = build_tokenizer(tmp_path / "a")
    build_tokenizer(tmp_path / "b")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    assert built.get_vocab() == tokenizer.get_vocab()
    samples = list(training_corpus(seed=7, lines=200)) + ["Hello  world\n\n  x", "it's 2026, ok?", "café ünï"]
    for text in samples:
        assert built.encode(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False), text
    assert built.chat_template == tokenizer.chat_template
