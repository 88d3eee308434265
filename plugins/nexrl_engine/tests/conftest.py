"""Shared fixtures: engines on the shipped tiny model and chat-formatted prompts."""

from __future__ import annotations

import pytest

from nexrl_engine import Engine
from nexrl_engine.tiny.addition import heldout_problems


@pytest.fixture(scope="session")
def shared_engine() -> Engine:
    """A full fine-tuning engine that tests must not train or reload (sampling, scoring)."""
    return Engine(model="nexrl-tiny", seed=0)


@pytest.fixture
def engine() -> Engine:
    """A fresh full fine-tuning engine a test may train."""
    return Engine(model="nexrl-tiny", seed=0)


@pytest.fixture(scope="session")
def chat_prompts(shared_engine: Engine) -> list[list[int]]:
    """Held-out addition prompts, chat formatted; their lengths differ (1- and 2-digit operands)."""
    tokenizer = shared_engine.tokenizer
    prompts = []
    for problem in heldout_problems(12):
        prompts.append(
            list(tokenizer.apply_chat_template(problem.messages(), add_generation_prompt=True, tokenize=True, return_dict=False))
        )
    assert len({len(p) for p in prompts}) > 1, "want prompts of different lengths"
    return prompts
