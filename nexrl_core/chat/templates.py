"""Chat-template helpers shared by every holder that tokenises locally.

They take a Hugging Face tokenizer (duck-typed, so the core imports no transformers) and
paper over two traps: under transformers 5 ``apply_chat_template(tokenize=True)`` returns
a dict-like ``BatchEncoding`` instead of token ids, and the end-of-turn marker that
sampling must stop at differs between template families.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

_PROBE = "NEXRLPROBE"


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    tokenize: bool = False,
) -> str | list[int]:
    """``apply_chat_template`` that returns a ``str``, or a plain ``list[int]`` when ``tokenize``."""
    rendered = tokenizer.apply_chat_template(
        [dict(message) for message in messages],
        tools=[dict(tool) for tool in tools] if tools else None,
        add_generation_prompt=add_generation_prompt,
        tokenize=tokenize,
        **({"return_dict": False} if tokenize else {}),
    )
    if not tokenize:
        return str(rendered)
    if isinstance(rendered, Mapping):
        rendered = rendered["input_ids"]
    return [int(token) for token in rendered]


class RenderCache:
    """`render_chat` with a memory of recent conversations.

    The ``group_size`` runs of a GRPO group render the same prompt at the same moment;
    rendering a Jinja template is the costliest thing a run does before it samples, and
    with a hundred rollout threads contending for the GIL it delays every request. A
    conversation is keyed by its JSON; one that is not JSON-serialisable is rendered
    every time.
    """

    def __init__(self, size: int = 4096) -> None:
        self._size = size
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, str | tuple[int, ...]] = OrderedDict()

    def render(
        self,
        tokenizer: Any,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
    ) -> str | list[int]:
        """What ``render_chat`` returns for the same arguments (a fresh list when ``tokenize``)."""
        try:
            key = json.dumps([messages, tools, add_generation_prompt, tokenize], sort_keys=True)
        except (TypeError, ValueError):
            return render_chat(tokenizer, messages, tools, add_generation_prompt, tokenize)
        with self._lock:
            cached = self._entries.get(key)
            if cached is not None:
                self._entries.move_to_end(key)
        if cached is None:
            rendered = render_chat(tokenizer, messages, tools, add_generation_prompt, tokenize)
            cached = tuple(rendered) if isinstance(rendered, list) else rendered
            with self._lock:
                self._entries[key] = cached
                while len(self._entries) > self._size:
                    self._entries.popitem(last=False)
        return list(cached) if isinstance(cached, tuple) else cached


def end_of_turn_marker(tokenizer: Any) -> str | None:
    """The text the template puts right after an assistant message (``<|im_end|>`` for ChatML).

    Found by rendering a probe reply rather than by a table of model families, so any
    local model directory with a chat template works.
    """
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
    text = str(render_chat(tokenizer, conversation, add_generation_prompt=False))
    after = text[text.rindex(_PROBE) + len(_PROBE) :] if _PROBE in text else ""
    marker = after.strip().split("\n")[0].strip()
    return marker or getattr(tokenizer, "eos_token", None)


def stop_token_ids(tokenizer: Any) -> list[int]:
    """Token ids sampling stops at: the end-of-turn marker when it is one token, and EOS."""
    ids: list[int] = []
    marker = end_of_turn_marker(tokenizer)
    if marker:
        encoded = tokenizer.encode(marker, add_special_tokens=False)
        if len(encoded) == 1:
            ids.append(int(encoded[0]))
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int) and eos not in ids:
        ids.append(eos)
    return ids
