"""The ``wandb`` sink: a Weights & Biases run with every metric at its step, the
resolved recipe as the run's config and the final model's path in its summary.

Its files go to ``<output.dir>/sinks/wandb`` unless ``options.dir`` says otherwise;
``options.mode: offline`` (or ``WANDB_MODE=offline``) writes the run there without a
network, for ``wandb sync`` to upload later. ``--resume`` continues the same W&B run:
its id is kept in the sink's work directory.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from nexrl_core.config.checks import non_empty, optional_non_empty
from nexrl_core.plugins.hookspecs import hookimpl
from nexrl_core.plugins.specs import MetricsSinkSpec
from nexrl_core.run.sinks import RunOutcome, SinkSetup
from nexrl_sinks.common import SinkUnavailable, TrackerRun, import_sdk, numbers_of, resumed_run

FINAL_MODEL_KEY = "final_model"
"""Summary key holding the final model's path."""


class WandbMode(str, enum.Enum):
    """Where W&B sends the run."""

    ONLINE = "online"
    """To the W&B server (needs ``WANDB_API_KEY`` or ``wandb login``)."""
    OFFLINE = "offline"
    """Only to local files, for ``wandb sync`` to upload later."""


@attrs.frozen(kw_only=True)
class WandbOptions:
    """Options of the ``wandb`` sink (``output.sinks: [{name: wandb, options: {...}}]``)."""

    project: str = attrs.field(default="nexrl", validator=non_empty)
    """W&B project the run goes to."""
    entity: str | None = attrs.field(default=None, validator=optional_non_empty)
    """W&B team or user; null: the API key's default entity."""
    run_name: str | None = attrs.field(default=None, validator=optional_non_empty)
    """Display name of the run; null: the output directory's name."""
    tags: list[str] = attrs.field(factory=list)
    """Tags of the run."""
    mode: WandbMode | None = None
    """``online`` or ``offline``; null: W&B's own choice (``WANDB_MODE``, else online)."""
    dir: str | None = attrs.field(default=None, validator=optional_non_empty)
    """Where W&B writes its files; null: ``<output.dir>/sinks/wandb``."""


class WandbSink:
    """One W&B run per NexRL run, continued on ``--resume``."""

    def __init__(self, setup: SinkSetup) -> None:
        wandb = import_sdk("wandb", "wandb")
        options: WandbOptions = setup.options
        self.work_dir = setup.work_dir
        previous = resumed_run(setup.work_dir, setup.resumed_from)
        files_dir = Path(options.dir) if options.dir else setup.work_dir
        files_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.run: Any = wandb.init(
                project=options.project,
                entity=options.entity,
                name=options.run_name or setup.run_name,
                tags=list(options.tags),
                config=setup.config,
                id=previous.run_id if previous else None,
                resume="allow" if previous else None,
                dir=str(files_dir),
                mode=options.mode.value if options.mode else None,
                settings=wandb.Settings(console="off"),
            )
        except Exception as error:  # noqa: BLE001 - every init failure refuses the run with its fix
            raise SinkUnavailable(
                f"wandb.init failed: {type(error).__name__}: {error}. For online runs set WANDB_API_KEY (or run "
                "`wandb login`); to log without a network set the sink's option mode: offline"
            ) from None
        self.tracker = previous or TrackerRun(run_id=self.run.id)
        self.tracker.save(self.work_dir)

    def log(self, row: Mapping[str, Any]) -> None:
        step = int(row["step"])
        if not self.tracker.is_new(step):
            return
        self.run.log(numbers_of(row), step=step)
        self.tracker = attrs.evolve(self.tracker, last_step=step)
        self.tracker.save(self.work_dir)

    def log_final_model(self, path: Path) -> None:
        self.run.summary[FINAL_MODEL_KEY] = str(path)

    def close(self, outcome: RunOutcome) -> None:
        self.run.finish(exit_code=0 if outcome is RunOutcome.FINISHED else 1)

    def location(self) -> str:
        if self.run.offline:
            return f"{self.run.settings.sync_dir} (offline; upload it with: wandb sync {self.run.settings.sync_dir})"
        return str(self.run.url)


@hookimpl
def nexrl_metrics_sinks() -> list[MetricsSinkSpec]:
    return [
        MetricsSinkSpec(
            name="wandb",
            factory="nexrl_sinks.wandb_sink:WandbSink",
            config_class=WandbOptions,
            description="A Weights & Biases run (online, or offline for wandb sync); pip install 'nexrl[wandb]'",
        )
    ]
