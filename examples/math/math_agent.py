"""The agent of the grade-school math example: one question, one reply, a verified reward.

The item is a row in verl's layout: ``prompt`` holds the chat messages, and
``reward_model.ground_truth`` the reference answer. `nexrl_math.math_reward` finds the
reply's final answer (``\\boxed{}`` first) and compares values, so ``\\boxed{0.75}``,
``3/4`` and ``\\frac{3}{4}`` all match a reference of ``3/4``. ``answered`` (in
``metrics.jsonl`` as ``agent/answered``) is the share of replies that state an answer at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nexrl_math import extract_answer, math_reward


def solve(item: Mapping[str, Any], llm: Any) -> dict[str, float]:
    reply = llm.chat.completions.create(messages=list(item["prompt"]))
    text = reply.choices[0].message.content or ""
    return {
        "reward": math_reward(text, item["reward_model"]["ground_truth"]),
        "answered": 0.0 if extract_answer(text) is None else 1.0,
    }
