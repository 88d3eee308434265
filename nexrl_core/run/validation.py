"""Held-out runs: the one code path behind a run's validation and ``nexrl eval``.

Both submit the task's held-out items to the rollout source at ``rollout.val_temperature``
with the seeds `DataLoader.val_requests` gives (which do not depend on the step), and
summarise the batch the same way, so ``nexrl eval`` on a run's final weights reproduces
the run's last validation row.
"""

from __future__ import annotations

import time

import attrs

from nexrl_core.run.data import DataLoader
from nexrl_core.run.rollout import RolloutBatch
from nexrl_core.training.backend import RolloutSource


@attrs.frozen(kw_only=True)
class Validation:
    """One pass over the held-out items: every run, and how long the pass took."""

    batch: RolloutBatch
    items: int
    samples: int
    """Runs per item."""
    seconds: float
    """Wall-clock time of the whole pass (runs go concurrently)."""

    def metrics(self) -> dict[str, float]:
        """The ``val/`` metrics a run logs (``val/count`` is the number of runs)."""
        metrics = self.batch.metrics(prefix="val/")
        metrics["val/count"] = float(len(self.batch.runs))
        metrics["time/val_s"] = self.seconds
        return metrics


def run_validation(runner: RolloutSource, loader: DataLoader, step: int, *, temperature: float, samples: int = 1) -> Validation | None:
    """Run every held-out item ``samples`` times; None when the task has no held-out items."""
    requests = loader.val_requests(step, samples)
    if not requests:
        return None
    started = time.monotonic()
    batch = runner.submit(step, requests, temperature=temperature).result()
    return Validation(batch=batch, items=len(loader.task.val_items), samples=samples, seconds=time.monotonic() - started)
