"""Chat-template helpers on a real tokenizer (the shipped tiny model's)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from nexrl_core.chat.templates import RenderCache, end_of_turn_marker, render_chat, stop_token_ids

loading = pytest.importorskip("nexrl_engine.loading")


class CountingTokenizer:
    """The real tokenizer, counting how often its template is rendered."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.renders = 0
        self._lock = threading.Lock()

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self.renders += 1
        return self._tokenizer.apply_chat_template(*args, **kwargs)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(loading.resolve_model_dir("nexrl-tiny"))


MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def test_render_chat_gives_text_or_plain_token_ids(tokenizer: Any) -> None:
    text = render_chat(tokenizer, MESSAGES)
    tokens = render_chat(tokenizer, MESSAGES, tokenize=True)
    assert isinstance(text, str) and "What is 2 + 3?" in text
    assert isinstance(tokens, list) and all(type(token) is int for token in tokens)
    assert tokenizer.decode(tokens) == text
    assert end_of_turn_marker(tokenizer) == "<|im_end|>"
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in stop_token_ids(tokenizer)


def test_the_cache_renders_each_conversation_once(tokenizer: Any) -> None:
    counting = CountingTokenizer(tokenizer)
    cache = RenderCache()
    for tokenize in (False, True, True):
        for tools in (None, TOOLS, TOOLS):
            assert cache.render(counting, MESSAGES, tools, True, tokenize) == render_chat(tokenizer, MESSAGES, tools, True, tokenize)
    assert counting.renders == 4  # (text, tokens) x (no tools, tools)
    first = cache.render(counting, MESSAGES, tokenize=True)
    first.append(-1)  # callers get their own list
    assert cache.render(counting, MESSAGES, tokenize=True)[-1] != -1
    other = [{"role": "user", "content": "What is 2 + 4?"}]
    assert cache.render(counting, other) != cache.render(counting, MESSAGES)
    assert counting.renders == 5


def test_the_cache_forgets_the_oldest_and_skips_what_json_cannot_key(tokenizer: Any) -> None:
    counting = CountingTokenizer(tokenizer)
    cache = RenderCache(size=2)
    conversations = [[{"role": "user", "content": f"q{index}"}] for index in range(3)]
    for messages in conversations:
        cache.render(counting, messages)
    cache.render(counting, conversations[2])
    assert counting.renders == 3
    cache.render(counting, conversations[0])
    assert counting.renders == 4

    unkeyable = [{"role": "user", "content": "hi", "metadata": object()}]  # the template ignores extra keys
    before = counting.renders
    for _ in range(2):
        assert cache.render(counting, unkeyable) == render_chat(tokenizer, unkeyable)
    assert counting.renders == before + 2
