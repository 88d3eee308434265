"""The small JSON file that lets ``nexrl train --resume`` continue a run exactly.

It is written once the backend's save of a checkpoint has finished (a background save
is recorded when its future completes, see `nexrl_core.run.checkpoints`), atomically
(temporary file, then rename), so after a crash or Ctrl-C it always names a complete
checkpoint. Together with
the rule that every random choice is a function of (seed, step, ...), it is all a resumed
run needs to produce the same metrics as an uninterrupted one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from nexrl_core.run.metrics import write_atomic

RUN_STATE_FILE = "run_state.json"
RUN_STATE_VERSION = 1


class TrainingError(RuntimeError):
    """A run cannot start or continue for a reason the user can fix (the message says how)."""


@attrs.frozen(kw_only=True)
class RunState:
    """Where a run stood at its last checkpoint."""

    step: int
    """Training steps completed."""
    checkpoint_path: str
    """The path the backend's ``save_checkpoint`` returned (or its future resolved to);
    passed to ``load_checkpoint``."""
    seed: int
    next_batch: int
    """The next training batch to roll out (batches before it are trained or in ``pending``)."""
    data_position: int
    """Position in the item stream of ``next_batch``'s first item."""
    total_agent_errors: int
    """Failed agent runs so far, for ``rollout.max_agent_errors``."""
    metrics: list[dict[str, Any]]
    """Every metrics row written so far (a resumed run rewrites metrics.jsonl from these)."""
    pending: list[dict[str, Any]] = attrs.field(factory=list)
    """Rolled-out batches not yet trained on (only with ``rollout.max_staleness`` > 0)."""
    config: dict[str, Any] = attrs.field(factory=dict)
    """The recipe the run was started with."""
    checkpoints: list[dict[str, Any]] = attrs.field(factory=list)
    """Every checkpoint of the run so far, oldest first, as ``{"step", "path"}``, so
    ``nexrl export`` can write the model of any of them."""
    version: int = RUN_STATE_VERSION

    def checkpoint_paths(self) -> dict[int, str]:
        """Step → what ``load_checkpoint`` takes, for every checkpoint of the run."""
        paths = {int(entry["step"]): str(entry["path"]) for entry in self.checkpoints}
        paths.setdefault(self.step, self.checkpoint_path)
        return dict(sorted(paths.items()))


def save_run_state(out_dir: Path, state: RunState) -> Path:
    path = out_dir / RUN_STATE_FILE
    write_atomic(path, json.dumps(attrs.asdict(state), indent=1) + "\n")
    return path


def load_run_state(out_dir: Path) -> RunState | None:
    """The run state in ``out_dir``, or None when there is none.

    :raises TrainingError: when the file exists but cannot be used.
    """
    path = out_dir / RUN_STATE_FILE
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise TrainingError(f"cannot read the run state {path}: {error}") from None
    if not isinstance(data, Mapping) or data.get("version") != RUN_STATE_VERSION:
        raise TrainingError(f"{path} was written by an incompatible NexRL version (expected run-state version {RUN_STATE_VERSION})")
    try:
        return RunState(**data)
    except TypeError as error:
        raise TrainingError(f"{path} is malformed: {error}") from None


def config_differences(saved: Mapping[str, Any], current: Mapping[str, Any], path: str = "") -> list[str]:
    """Dotted keys whose values differ between two dumped recipes."""
    differences = []
    for key in sorted(set(saved) | set(current), key=str):
        here = f"{path}.{key}" if path else str(key)
        old, new = saved.get(key), current.get(key)
        if isinstance(old, Mapping) and isinstance(new, Mapping):
            differences += config_differences(old, new, here)
        elif old != new:
            differences.append(f"{here}: {old!r} -> {new!r}")
    return differences
