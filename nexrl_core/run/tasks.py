"""Tasks: where prompts come from, what the agent does with them, and how it is scored.

A recipe names either a registered task (``task.name: addition``) or a data file of
items (JSON lines, parquet, a ``datasets`` directory: `nexrl_core.run.data_files`) plus an
agent function (``task.data_path`` and ``task.agent: module:function``).
Either way the loop sees the same two things: a stream of items and an agent.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from nexrl_core.run.rollout import Agent


class Task(Protocol):
    """A registered task: items for training and validation, and the agent that runs them."""

    agent: Agent

    def train_items(self, seed: int) -> Iterator[Mapping[str, Any]]:
        """Training items in a seeded order; may be endless."""
        ...

    def val_items(self) -> list[Mapping[str, Any]]:
        """A fixed held-out set that training never sees."""
        ...
