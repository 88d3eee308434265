"""Turns recipe-key recording on in every Python process a test starts.

While recording (`nexrl_testing.recipe_key_records`), the pytest plugin puts this
folder first on ``PYTHONPATH``, so Python runs this file at the start of each process a
test starts. It imports nothing of NexRL itself: it waits for the process to import each
module recording hooks into, and hands it to ``instrument`` once it has run. Any other
``sitecustomize`` on the path still runs after this one.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from typing import Any

_RECORDS_ENV = "NEXRL_RECIPE_KEY_RECORDS"
_WATCHED = {"nexrl_core.config.converter", "nexrl_core.config.schema", "nexrl_core.training.holders", "nexrl_core.plugins.registry"}
"""`nexrl_testing.recipe_key_records.INSTRUMENTED_MODULES`, spelled out so that
nothing is imported before the process asks for it."""


class _InstrumentOnceImported(importlib.abc.MetaPathFinder):
    """Finds a watched module the usual way and instruments it once it has run."""

    def __init__(self) -> None:
        self.waiting = set(_WATCHED)

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name not in self.waiting:
            return None
        self.waiting.discard(name)
        if not self.waiting:
            sys.meta_path.remove(self)
        spec = next(
            (found for finder in sys.meta_path if finder is not self and (found := finder.find_spec(name, path, target))),
            None,
        )  # fmt: skip
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run_module(module)
            from nexrl_testing import recipe_key_records

            recipe_key_records.start_recording(os.environ[_RECORDS_ENV])
            recipe_key_records.instrument(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _run_the_next_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


# A process of a Python without nexrl-testing (a fresh venv a test builds from wheels) has no
# recorder: it records nothing rather than fail to import one.
if os.environ.get(_RECORDS_ENV) and importlib.util.find_spec("nexrl_testing") is not None:
    sys.meta_path.insert(0, _InstrumentOnceImported())
_run_the_next_sitecustomize()
