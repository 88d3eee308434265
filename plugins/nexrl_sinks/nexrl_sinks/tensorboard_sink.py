"""The ``tensorboard`` sink, a default one: every metric as a TensorBoard scalar, in
``<output.dir>/sinks/tensorboard``, written with tensorboardX.

It registers itself as a default, so a recipe that leaves ``output.sinks`` unset writes
TensorBoard files. On ``--resume`` the events a crashed run wrote after its checkpoint
are dropped (``purge_step``) and written again by the resumed run.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from nexrl_core.plugins.hookspecs import hookimpl
from nexrl_core.plugins.specs import MetricsSinkSpec
from nexrl_core.run.sinks import RunOutcome, SinkSetup
from nexrl_sinks.common import import_sdk, numbers_of

FLUSH_SECS = 10


def tensorboard_command(log_dir: Path) -> str:
    """The command that shows ``log_dir``: TensorBoard beside this interpreter (a venv's
    ``bin/``, which need not be on PATH), or how to install it."""
    beside = Path(sys.executable).parent / "tensorboard"
    if beside.exists():
        return f"{beside} --logdir {log_dir}"
    return f"tensorboard --logdir {log_dir}   (install it with: pip install 'nexrl[tensorboard]')"


class TensorBoardSink:
    """Scalars per step, the recipe and the final model's path as text."""

    def __init__(self, setup: SinkSetup) -> None:
        writer_module = import_sdk("tensorboardX", "tensorboard")
        self.log_dir = setup.work_dir
        purge_step = setup.resumed_from + 1 if setup.resumed_from is not None else None
        self._writer: Any = writer_module.SummaryWriter(logdir=str(self.log_dir), purge_step=purge_step, flush_secs=FLUSH_SECS)
        recipe = yaml.safe_dump(setup.config, sort_keys=False)
        self._writer.add_text("recipe", "```yaml\n" + recipe + "```", global_step=setup.resumed_from or 0)

    def log(self, row: Mapping[str, Any]) -> None:
        step = int(row["step"])
        for key, value in numbers_of(row).items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def log_final_model(self, path: Path) -> None:
        self._writer.add_text("final_model", str(path))

    def close(self, outcome: RunOutcome) -> None:
        # tensorboardX hands events to its writer thread through a multiprocessing queue,
        # whose feeder thread outlives close() for a moment; wait for it, so that nothing
        # the run started is still running when the run returns.
        queues = [writer.event_writer._event_queue for writer in (self._writer.all_writers or {}).values()]
        self._writer.close()
        for queue in queues:
            queue.join_thread()

    def location(self) -> str:
        return tensorboard_command(self.log_dir)


@hookimpl
def nexrl_metrics_sinks() -> list[MetricsSinkSpec]:
    return [
        MetricsSinkSpec(
            name="tensorboard",
            factory="nexrl_sinks.tensorboard_sink:TensorBoardSink",
            description="TensorBoard event files in <output.dir>/sinks/tensorboard (a default sink)",
            default=True,
        )
    ]
