"""`freeze_long_lived_objects` takes what exists now out of later full collections, and
collects what is already garbage first (frozen garbage would never be freed)."""

from __future__ import annotations

import gc
import weakref

from nexrl_core.longlived import freeze_long_lived_objects


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_garbage_is_collected_and_live_objects_are_frozen() -> None:
    gc.unfreeze()
    gc.disable()  # no automatic collection may free the garbage behind the call's back
    try:
        garbage = weakref.ref(Node())
        kept = [Node() for _ in range(100)]
        assert garbage() is not None, "the cycle outlives its last reference until a collection"
        freeze_long_lived_objects()
        assert garbage() is None, "garbage is collected before the freeze"
        tracked = {id(obj) for obj in gc.get_objects()}
        assert not any(id(node) in tracked for node in kept), "live objects leave the collector's generations"
        assert gc.get_freeze_count() >= len(kept)
    finally:
        gc.enable()
        gc.unfreeze()
