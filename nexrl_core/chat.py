"""Chat-template helpers shared by every holder that tokenises locally.

They take a Hugging Face tokenizer (duck-typed, so the core imports no transformers) and
paper over two traps: under transformers 5 ``apply_chat_template(tokenize=True)`` returns
a dict-like ``BatchEncoding`` instead of token ids, and the end-of-turn marker that
sampling must stop at differs between template families.
"""

from __future__ import annotations

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
