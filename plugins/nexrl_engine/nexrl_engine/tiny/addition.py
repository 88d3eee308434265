"""The demo task of the shipped tiny model: two-digit addition with an exact-match reward.

The tiny model is pretrained on this task (with deliberately noisy labels) by
`nexrl_engine.tiny.build`, and `nexrl train`'s quickstart improves it with RL. Both must
draw prompts from the same place and must never train on the held-out split, so the
split is fixed here once: every pair ``(a, b)`` with ``0 <= a, b <= 99`` is in exactly
one split, chosen by a seeded shuffle that does not depend on anything else.

This module is pure Python (no torch), so rollout workers and config validation can
import it cheaply.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Literal

import attrs

__all__ = [
    "AdditionProblem",
    "HELDOUT_SIZE",
    "MAX_OPERAND",
    "Split",
    "heldout_problems",
    "parse_answer",
    "problems",
    "reward",
    "sample_problems",
    "train_problems",
]

MAX_OPERAND = 99
"""Operands range over 0..99, so answers have one to three digits."""
HELDOUT_SIZE = 1000
"""Pairs reserved for evaluation, out of the 10 000 possible."""
_SPLIT_SEED = 20260101
"""Seed of the shuffle that assigns pairs to splits; changing it changes the task."""

Split = Literal["train", "heldout"]


@attrs.frozen
class AdditionProblem:
    """One question ``"a+b="`` whose exact answer is ``str(a + b)``."""

    a: int
    b: int

    @property
    def prompt(self) -> str:
        """The user message, e.g. ``"12+7="``."""
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        """The exact string the assistant must reply with."""
        return str(self.a + self.b)

    def messages(self) -> list[dict[str, str]]:
        """Chat messages for ``apply_chat_template(..., add_generation_prompt=True)``."""
        return [{"role": "user", "content": self.prompt}]

    def reward(self, response_text: str) -> float:
        """1.0 when the response is exactly the sum (surrounding whitespace and a trailing
        end-of-turn marker allowed), else 0.0."""
        return reward(self, response_text)


_END_MARKERS = ("<|im_end|>", "<|endoftext|>")


def parse_answer(response_text: str) -> str:
    """The response without end-of-turn markers and surrounding whitespace."""
    text = response_text.strip()
    changed = True
    while changed:
        changed = False
        for marker in _END_MARKERS:
            if text.endswith(marker):
                text = text[: -len(marker)].rstrip()
                changed = True
    return text


_DIGITS = re.compile(r"^\d+$")


def reward(problem: AdditionProblem, response_text: str) -> float:
    """Exact match: the reply must be the sum's digits and nothing else."""
    answer = parse_answer(response_text)
    return 1.0 if _DIGITS.match(answer) and answer == problem.answer else 0.0


@lru_cache(maxsize=1)
def _splits() -> tuple[tuple[AdditionProblem, ...], tuple[AdditionProblem, ...]]:
    pairs = [AdditionProblem(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    random.Random(_SPLIT_SEED).shuffle(pairs)
    heldout = tuple(pairs[:HELDOUT_SIZE])
    train = tuple(pairs[HELDOUT_SIZE:])
    return train, heldout


def problems(split: Split) -> tuple[AdditionProblem, ...]:
    """Every problem of a split, in a fixed order."""
    train, heldout = _splits()
    if split == "train":
        return train
    if split == "heldout":
        return heldout
    raise ValueError(f"unknown split {split!r}; choose 'train' or 'heldout'")


def train_problems() -> tuple[AdditionProblem, ...]:
    """The 9 000 problems training (pretraining and RL) may use."""
    return problems("train")


def heldout_problems(n: int | None = None) -> tuple[AdditionProblem, ...]:
    """The first ``n`` (default all 1 000) held-out problems, for evaluation only."""
    held = problems("heldout")
    return held if n is None else held[:n]


def sample_problems(rng: random.Random, n: int, split: Split = "train") -> list[AdditionProblem]:
    """``n`` problems drawn with replacement from a split by ``rng``."""
    pool: Sequence[AdditionProblem] = problems(split)
    return [pool[rng.randrange(len(pool))] for _ in range(n)]
