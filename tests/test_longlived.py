"""`freeze_long_lived_objects` takes what exists now out of later full collections."""

from __future__ import annotations

import gc

from nexrl_core.longlived import freeze_long_lived_objects


def test_objects_alive_at_the_call_are_frozen_and_garbage_is_not() -> None:
    class Node:
        def __init__(self) -> None:
            self.me = self  # a reference cycle: only the cyclic collector frees it

    gc.unfreeze()
    try:
        Node()  # garbage already: collected, not frozen
        kept = [Node() for _ in range(100)]
        freeze_long_lived_objects()
        assert gc.get_freeze_count() >= len(kept)
        collected = [obj for obj in gc.get_objects() if isinstance(obj, Node)]
        assert collected == [], "frozen objects are out of the collector's generations, garbage is gone"
    finally:
        gc.unfreeze()
