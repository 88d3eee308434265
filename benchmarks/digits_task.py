"""The dense reward `scaling.py` trains on: the fraction of the reply that is digits.

A randomly initialised model answers exact-match tasks with all-zero groups, so GRPO
has nothing to learn from. The digit fraction of the reply is graded instead of all or
nothing: a random model over the shipped 1 024-token vocabulary (ten of them single
digits) already scores a little, most GRPO groups differ, and every digit it learns to
emit raises the reward. (Closeness of the reply length to a target would not do: a
random model almost never samples the end-of-turn token, so every reply has the maximum
length and every group ties.) The shipped tiny model, pretrained to answer additions,
already replies in digits, so at that size the reward only checks that training does
not break it.

The prompts are the addition task's (``{"a": 12, "b": 7}`` asks ``12+7=``); only the
reward differs. Pure Python, so NexRL's rollout threads import it cheaply as
``task.agent: digits_task:agent``.

`reply_length` (``task.agent: digits_task:length_agent``, ``scaling.py --reward length``)
is denser still, for throughput runs: the reply's length in characters. Digits are 13 of
the shipped tokenizer's 1 024 tokens, so a random model emits one in few replies and most
GRPO groups tie, which NexRL skips (nothing to learn) and TRL trains anyway; replies of
random tokens differ in length in almost every group, so every side trains every row.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nexrl_engine.tiny.addition import AdditionProblem, parse_answer


def digit_fraction(response_text: str) -> float:
    """Digits over characters of the reply without end-of-turn markers and surrounding
    whitespace; an empty reply scores 0."""
    text = parse_answer(response_text)
    return sum(character.isdigit() for character in text) / len(text) if text else 0.0


def messages(item: Mapping[str, Any]) -> list[dict[str, str]]:
    """The chat an item asks: the addition prompt ``a+b=``."""
    return AdditionProblem(int(item["a"]), int(item["b"])).messages()


def agent(item: Mapping[str, Any], llm: Any) -> float:
    """Ask once through the OpenAI-shaped client; reward the reply's digit fraction."""
    completion = llm.chat.completions.create(messages=messages(item))
    return digit_fraction(completion.choices[0].message.content or "")


LENGTH_SCALE = 64
"""`reply_length` is the reply's characters over this, at most 1."""


def reply_length(response_text: str) -> float:
    """Characters of the reply (without end-of-turn markers and surrounding whitespace)
    over `LENGTH_SCALE`, at most 1."""
    return min(1.0, len(parse_answer(response_text)) / LENGTH_SCALE)


def length_agent(item: Mapping[str, Any], llm: Any) -> float:
    """Ask once; reward the reply's length (`reply_length`)."""
    completion = llm.chat.completions.create(messages=messages(item))
    return reply_length(completion.choices[0].message.content or "")


REWARDS = {"digits": (digit_fraction, "digits_task:agent"), "length": (reply_length, "digits_task:length_agent")}
"""``scaling.py --reward``: name -> (score of a reply's raw text, ``task.agent``)."""
