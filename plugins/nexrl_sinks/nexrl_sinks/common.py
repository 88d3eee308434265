"""What the sinks share: importing a tracker SDK with the extra that installs it, the
tracker run a sink continues on ``--resume``, and the numbers of a metrics row."""

from __future__ import annotations

import importlib
import json
import numbers
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs

from nexrl_core.run.metrics import write_atomic

TRACKER_RUN_FILE = "tracker_run.json"
"""In a sink's work directory: the tracker's run id and the last step it got."""


class SinkUnavailable(RuntimeError):
    """A sink cannot start: its SDK is missing or a setting it needs is not made."""


def import_sdk(module: str, extra: str) -> ModuleType:
    """Import a tracker SDK, or say which NexRL extra installs it.

    :raises SinkUnavailable: when ``module`` is not installed.
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise SinkUnavailable(f"the {module} package is not installed ({error}); install it with: pip install 'nexrl[{extra}]'") from None


@attrs.frozen
class TrackerRun:
    """The tracker's run this NexRL run reports to, saved so ``--resume`` continues it."""

    run_id: str
    last_step: int | None = None
    """The last step the tracker got; a resumed run sends only later steps, so a step
    the interrupted process already sent is not recorded twice."""

    @classmethod
    def load(cls, work_dir: Path) -> TrackerRun | None:
        path = work_dir / TRACKER_RUN_FILE
        if not path.exists():
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
        return cls(run_id=data["run_id"], last_step=data.get("last_step"))

    def save(self, work_dir: Path) -> None:
        write_atomic(work_dir / TRACKER_RUN_FILE, json.dumps(attrs.asdict(self)) + "\n")

    def is_new(self, step: int) -> bool:
        return self.last_step is None or step > self.last_step


def resumed_run(work_dir: Path, resumed_from: int | None) -> TrackerRun | None:
    """The tracker run to continue: the saved one on ``--resume``, none on a fresh run
    (``--overwrite`` removed the work directory, a fresh run never reads it)."""
    return TrackerRun.load(work_dir) if resumed_from is not None else None


def numbers_of(row: Mapping[str, Any]) -> dict[str, float]:
    """The row's metrics a tracker plots: real numbers, ``step`` and nulls left out."""
    return {
        key: float(value) for key, value in row.items() if key != "step" and isinstance(value, numbers.Real) and not isinstance(value, bool)
    }


def flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested recipe as ``dotted.key → value`` text, for trackers whose parameters are flat."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            flat.update(flat_config(value, path))
        else:
            flat[path] = json.dumps(value) if not isinstance(value, str) else value
    return flat
