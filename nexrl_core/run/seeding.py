"""Seeds derived from names, so every random choice of a run is a function of its position.

A training run makes random choices in many threads (which prompts a step uses, what
each agent run samples). Drawing them from one shared generator would tie the results
to thread scheduling and make a resumed run diverge from an uninterrupted one. Instead
each choice gets its own seed, hashed from the run seed and where the choice is made:
``derive_seed(seed, "train", step, item)`` seeds the runs of one item in one step.
"""

from __future__ import annotations

import hashlib
import json

SEED_BITS = 31
"""Derived seeds fit in a signed 32-bit integer, which every backend accepts."""


def derive_seed(*parts: object) -> int:
    """A seed in ``[0, 2**31)`` that depends only on ``parts`` (ints, strings, None).

    Stable across processes and Python versions (it does not use ``hash()``).
    """
    text = json.dumps([part if isinstance(part, (int, str, type(None))) else repr(part) for part in parts])
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") & ((1 << SEED_BITS) - 1)


def call_seed(group_seed: int, call_index: int, run_id: int, user_seed: int | None = None) -> int:
    """Seed of the ``call_index``-th LLM call of run ``run_id`` of a group.

    The runs of a group get consecutive seeds for the same call (``s, s+1, ...``), so a
    service holder can send their identical first prompts as one multi-sample request
    without changing any run's sample (`nexrl_core.training.coalesce`). An agent's own ``seed``
    argument is mixed in, so equal user seeds do not make a group's runs identical.
    """
    parts = (group_seed, call_index) if user_seed is None else (group_seed, call_index, user_seed)
    return (derive_seed(*parts) + run_id) % (1 << SEED_BITS)
