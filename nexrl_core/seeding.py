"""Seeds derived from names, so every random choice of a run is a function of its position.

A training run makes random choices in many threads (which prompts a step uses, what
each agent run samples). Drawing them from one shared generator would tie the results
to thread scheduling and make a resumed run diverge from an uninterrupted one. Instead
each choice gets its own seed, hashed from the run seed and where the choice is made:
``derive_seed(seed, "sample", step, item, run, call)``.
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
