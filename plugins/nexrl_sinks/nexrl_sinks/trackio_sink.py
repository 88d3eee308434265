"""The ``trackio`` sink: a Trackio run, local first, with every metric at its step, the
resolved recipe as the run's config and the final model as an artifact.

Trackio keeps its projects in one local database folder (``TRACKIO_DIR``, by default
in the Hugging Face cache); ``trackio show`` opens its dashboard on them. ``--resume``
continues the run of the same name in the same project.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from nexrl_core.config.checks import non_empty, optional_non_empty
from nexrl_core.plugins.hookspecs import hookimpl
from nexrl_core.plugins.specs import MetricsSinkSpec
from nexrl_core.run.sinks import RunOutcome, SinkSetup
from nexrl_sinks.common import SinkUnavailable, TrackerRun, import_sdk, numbers_of, resumed_run

FINAL_MODEL_ARTIFACT = "final_model"
"""Name of the final model's artifact."""


@attrs.frozen(kw_only=True)
class TrackioOptions:
    """Options of the ``trackio`` sink (``output.sinks: [{name: trackio, options: {...}}]``)."""

    project: str = attrs.field(default="nexrl", validator=non_empty)
    """Trackio project the run goes to."""
    run_name: str | None = attrs.field(default=None, validator=optional_non_empty)
    """Name of the run (what ``--resume`` finds it by); null: the output directory's name."""
    group: str | None = attrs.field(default=None, validator=optional_non_empty)
    """Group the run is shown in on the dashboard."""


class TrackioSink:
    """One Trackio run per NexRL run, continued on ``--resume``."""

    def __init__(self, setup: SinkSetup) -> None:
        trackio = import_sdk("trackio", "trackio")
        options: TrackioOptions = setup.options
        self.work_dir = setup.work_dir
        self.project = options.project
        name = options.run_name or setup.run_name
        previous = resumed_run(setup.work_dir, setup.resumed_from)
        try:
            self.run: Any = trackio.init(
                project=options.project,
                name=previous.run_id if previous else name,
                group=options.group,
                config=setup.config,
                resume="allow" if previous else "never",
                embed=False,
                auto_log_gpu=False,
                auto_log_cpu=False,
            )
        except Exception as error:  # noqa: BLE001 - every start failure refuses the run with what to fix
            raise SinkUnavailable(f"trackio.init failed: {type(error).__name__}: {error}") from None
        self.tracker = previous or TrackerRun(run_id=self.run.name)
        self.tracker.save(self.work_dir)

    def log(self, row: Mapping[str, Any]) -> None:
        step = int(row["step"])
        if not self.tracker.is_new(step):
            return
        self.run.log(numbers_of(row), step=step)
        self.tracker = attrs.evolve(self.tracker, last_step=step)
        self.tracker.save(self.work_dir)

    def log_final_model(self, path: Path) -> None:
        self.run.log_artifact(str(path), name=FINAL_MODEL_ARTIFACT, type="model")

    def close(self, outcome: RunOutcome) -> None:
        self.run.finish()

    def location(self) -> str:
        return f"trackio show --project {self.project}   (run {self.tracker.run_id})"


@hookimpl
def nexrl_metrics_sinks() -> list[MetricsSinkSpec]:
    return [
        MetricsSinkSpec(
            name="trackio",
            factory="nexrl_sinks.trackio_sink:TrackioSink",
            config_class=TrackioOptions,
            description="A local-first Trackio run (trackio show); pip install 'nexrl[trackio]'",
        )
    ]
