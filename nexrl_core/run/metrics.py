"""What a run reports itself: one JSON object per step, a PNG reward curve, and a
progress bar (or one plain line per step when stdout is not a terminal). Trackers
(TensorBoard, Weights & Biases, ...) are metrics sink plugins (`nexrl_core.run.sinks`).

matplotlib and rich are imported inside the functions that use them, so importing this
module (and the core) stays cheap.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import numbers
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

logger = logging.getLogger("nexrl.train")

METRICS_FILE = "metrics.jsonl"
REWARD_CURVE_FILE = "reward_curve.png"

WALL_CLOCK_PREFIXES = ("time/", "perf/")
"""Metrics measured in wall-clock time; the only ones that differ between two runs of
the same recipe (an interrupted-and-resumed run included)."""


def clean_row(step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """``step`` first, then every metric sorted by key; NaN and inf become null (valid JSON)."""
    row: dict[str, Any] = {"step": step}
    for key in sorted(metrics):
        if key == "step":
            continue
        value = metrics[key]
        if isinstance(value, float) and not math.isfinite(value):
            value = None
        row[key] = value
    return row


def readable_train_metrics(values: Mapping[str, Any], prefix: str = "train/") -> dict[str, float]:
    """A training call's real-number metrics under ``prefix``, plus plain names for the
    Tinker-style ``name:reduction`` keys every NexRL trainer reports: ``x:mean`` is also
    ``x``, and ``loss:sum`` over ``num_tokens:sum`` is ``loss`` (per token)."""
    out: dict[str, float] = {}
    for key, value in (values or {}).items():
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            out[key if key.startswith(prefix) else f"{prefix}{key}"] = float(value)
    for key, value in list(out.items()):
        if key.endswith(":mean") and key[: -len(":mean")] not in out:
            out[key[: -len(":mean")]] = value
    tokens = out.get(f"{prefix}num_tokens:sum")
    if f"{prefix}loss" not in out and f"{prefix}loss:sum" in out and tokens:
        out[f"{prefix}loss"] = out[f"{prefix}loss:sum"] / tokens
    return out


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so a crash leaves either the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl file (a torn last line from a crash is dropped)."""
    rows: list[dict[str, Any]] = []
    if not path.exists():
        return rows
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


class MetricsLog:
    """Appends rows to ``metrics.jsonl``; keeps every row for the run state."""

    def __init__(self, out_dir: Path, rows: Sequence[Mapping[str, Any]] = ()) -> None:
        self.out_dir = out_dir
        self.path = out_dir / METRICS_FILE
        self.rows: list[dict[str, Any]] = [dict(row) for row in rows]
        # A resumed run restarts the file from the checkpoint's rows, dropping any written after it.
        write_atomic(self.path, "".join(json.dumps(row) + "\n" for row in self.rows))
        self._file: TextIO | None = open(self.path, "a", encoding="utf-8")

    def write(self, row: Mapping[str, Any]) -> None:
        self.rows.append(dict(row))
        assert self._file is not None, "the metrics log is closed"
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def plot_reward_curve(rows: Iterable[Mapping[str, Any]], path: Path) -> Path | None:
    """Train reward and validation reward against step, as a PNG; None when there is nothing to plot."""
    rows = list(rows)
    train = [(row["step"], row["reward/mean"]) for row in rows if row.get("reward/mean") is not None]
    val = [(row["step"], row["val/reward/mean"]) for row in rows if row.get("val/reward/mean") is not None]
    if not train and not val:
        return None
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        logger.warning("matplotlib is not installed; no %s is drawn (pip install matplotlib)", path.name)
        return None
    figure = Figure(figsize=(7, 4.2), dpi=120)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    if train:
        axes.plot([s for s, _ in train], [r for _, r in train], label="train reward (mean)", color="tab:blue", linewidth=1.2)
    if val:
        axes.plot(
            [s for s, _ in val],
            [r for _, r in val],
            label="validation reward (mean)",
            color="tab:orange",
            marker="o",
            linewidth=1.5,
        )
    axes.set_xlabel("step")
    axes.set_ylabel("reward")
    axes.set_title("NexRL reward curve")
    axes.grid(True, alpha=0.3)
    axes.legend(loc="best")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    figure.savefig(str(tmp), format="png")
    os.replace(tmp, path)
    return path


# --- progress ---------------------------------------------------------------------------------------


def use_progress_bar(stream: TextIO | None = None) -> bool:
    """A live bar only on a terminal and never under CI (``CI`` set in the environment)."""
    stream = stream or sys.stdout
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false"):
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)


def step_line(row: Mapping[str, Any], total: int, eta_seconds: float | None) -> str:
    """The one-line summary printed after each step."""
    parts = [f"step {row['step']}/{total}"]
    if "reward/mean" in row:
        parts.append(f"reward {_fmt(row['reward/mean'])}")
    if "val/reward/mean" in row:
        parts.append(f"val {_fmt(row['val/reward/mean'])} (n={int(row.get('val/count') or 0)})")
    for key, label in (("train/loss", "loss"), ("train/approx_kl", "kl")):
        if row.get(key) is not None:
            parts.append(f"{label} {row[key]:.4g}")
    if row.get("rollout/agent_errors"):
        parts.append(f"errors {int(row['rollout/agent_errors'])}")
    if row.get("time/step_s") is not None:
        parts.append(f"{row['time/step_s']:.2f}s/step")
    if eta_seconds is not None:
        parts.append(f"ETA {datetime.timedelta(seconds=round(eta_seconds))}")
    return "  ".join(parts)


class ProgressDisplay:
    """A rich progress bar (step, reward, ETA) over one line per step; lines only when not a TTY."""

    def __init__(self, total: int, completed: int, bar: bool | None = None, stream: TextIO | None = None) -> None:
        self.total = total
        self.completed = completed
        self._stream = stream or sys.stdout
        self._durations: list[float] = []
        self._progress: Any = None
        if use_progress_bar(self._stream) if bar is None else bar:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]step"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("reward {task.fields[reward]}"),
                TextColumn("val {task.fields[val]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=Console(file=self._stream),
                transient=False,
            )
            self._task = self._progress.add_task("train", total=total, completed=completed, reward="-", val="-")
            self._progress.start()

    def print(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self._stream, flush=True)

    def step_done(self, row: Mapping[str, Any], step_seconds: float | None) -> None:
        if step_seconds is not None:
            self._durations.append(step_seconds)
        self.completed = int(row["step"])
        eta = None
        if self._durations:
            eta = sum(self._durations) / len(self._durations) * max(self.total - self.completed, 0)
        if self._progress is not None:
            fields = {"reward": _fmt(row.get("reward/mean"))}
            if "val/reward/mean" in row:
                fields["val"] = _fmt(row["val/reward/mean"])
            self._progress.update(self._task, completed=self.completed, **fields)
        self.print(step_line(row, self.total, eta))

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
