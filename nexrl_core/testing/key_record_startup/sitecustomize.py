"""Turns recipe-key recording on in every Python process a test starts.

While recording (`nexrl_core.testing.recipe_key_records`), the pytest plugin puts this
folder first on ``PYTHONPATH``, so Python runs this file at the start of each process a
test starts. It imports nothing of NexRL itself: it waits until the process imports the
config converter, then starts recording there. Any other ``sitecustomize`` on the path
still runs after it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from typing import Any

_RECORDS_ENV = "NEXRL_RECIPE_KEY_RECORDS"
_CONVERTER = "nexrl_core.config.converter"


class _RecordOnceImported(importlib.abc.MetaPathFinder):
    """Finds the converter module the usual way and starts recording once it has run."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != _CONVERTER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run_module(module)
            from nexrl_core.testing.recipe_key_records import start_recording

            start_recording(os.environ[_RECORDS_ENV])

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _run_the_next_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


if os.environ.get(_RECORDS_ENV):
    sys.meta_path.insert(0, _RecordOnceImported())
_run_the_next_sitecustomize()
