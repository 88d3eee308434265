"""The ``addition`` task for ``nexrl train``: the tiny model's demo task as a registered task.

Items are plain mappings (``{"a": 12, "b": 7}``), so the same task can also be written
to JSONL; the agent asks the model once and scores the reply by exact match.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from typing import Any

from nexrl_engine.tiny.addition import AdditionProblem, heldout_problems, train_problems


def _item(problem: AdditionProblem) -> dict[str, Any]:
    return {"id": problem.prompt, "a": problem.a, "b": problem.b}


def solve(item: Mapping[str, Any], llm: Any) -> float:
    """Ask for ``a+b=`` once; reward 1 for exactly the sum, else 0."""
    problem = AdditionProblem(int(item["a"]), int(item["b"]))
    completion = llm.chat.completions.create(messages=problem.messages())
    return problem.reward(completion.choices[0].message.content or "")


class AdditionTask:
    """Two-digit addition on the 9 000 training pairs; validation on the fixed held-out split."""

    agent = staticmethod(solve)

    def __init__(self, config: object = None) -> None:
        del config

    def train_items(self, seed: int) -> Iterator[Mapping[str, Any]]:
        """Endless epochs over the training pairs, each reshuffled from ``seed`` and the epoch."""
        pool = list(train_problems())
        epoch = 0
        while True:
            order = list(range(len(pool)))
            random.Random(f"{seed}:{epoch}").shuffle(order)
            yield from (_item(pool[index]) for index in order)
            epoch += 1

    def val_items(self) -> list[Mapping[str, Any]]:
        return [_item(problem) for problem in heldout_problems()]
