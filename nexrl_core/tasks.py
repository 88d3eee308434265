"""Tasks: where prompts come from, what the agent does with them, and how it is scored.

A recipe names either a registered task (``task.name: addition``) or a JSONL file of
items plus an agent function (``task.data_path`` and ``task.agent: module:function``).
Either way the loop sees the same two things: a stream of items and an agent.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, Union

if TYPE_CHECKING:
    from nexrl_core.rollout import LLMClient

AgentResult = Union[float, Mapping[str, Any]]
"""What an agent returns: the reward, or a mapping with ``reward`` and optional extra metrics."""


class Agent(Protocol):
    """User code that solves one task item with the LLM and scores the outcome.

    It calls ``llm.chat.completions.create(...)`` as it would an OpenAI client, as many
    times as it likes; every call's tokens and logprobs are recorded and trained on.
    """

    def __call__(self, item: Mapping[str, Any], llm: LLMClient) -> AgentResult: ...


class Task(Protocol):
    """A registered task: items for training and validation, and the agent that runs them."""

    agent: Agent

    def train_items(self, seed: int) -> Iterator[Mapping[str, Any]]:
        """Training items in a seeded order; may be endless."""
        ...

    def val_items(self) -> list[Mapping[str, Any]]:
        """A fixed held-out set that training never sees."""
        ...
