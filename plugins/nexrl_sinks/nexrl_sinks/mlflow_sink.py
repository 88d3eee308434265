"""The ``mlflow`` sink: an MLflow run with every metric at its step, the resolved recipe
as the run's parameters (and as ``config.yaml``), and the final model as an artifact.

It talks to the tracking store ``options.tracking_uri`` names (a server, or a local
``sqlite:///...`` database) through `mlflow.MlflowClient`, so it never touches MLflow's
process-wide active run. ``--resume`` continues the same MLflow run: its id is kept in
the sink's work directory.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from nexrl_core.config.checks import non_empty, optional_non_empty
from nexrl_core.plugins.hookspecs import hookimpl
from nexrl_core.plugins.specs import MetricsSinkSpec
from nexrl_core.run.sinks import RunOutcome, SinkSetup
from nexrl_sinks.common import SinkUnavailable, TrackerRun, flat_config, import_sdk, numbers_of, resumed_run

FINAL_MODEL_ARTIFACT = "final_model"
"""Artifact folder (and tag) of the final model."""
CONFIG_ARTIFACT = "config.yaml"
"""The resolved recipe, as an artifact of the run."""
PARAMS_PER_CALL = 100
"""MLflow takes at most this many parameters in one ``log_batch``."""
MAX_PARAM_CHARS = 6000
"""MLflow's limit on a parameter's value; a longer value is cut (``config.yaml`` has it whole)."""
STATUS = {RunOutcome.FINISHED: "FINISHED", RunOutcome.FAILED: "FAILED", RunOutcome.INTERRUPTED: "KILLED"}
"""How a NexRL run's end reads in MLflow."""


@attrs.frozen(kw_only=True)
class MlflowOptions:
    """Options of the ``mlflow`` sink (``output.sinks: [{name: mlflow, options: {...}}]``)."""

    tracking_uri: str | None = attrs.field(default=None, validator=optional_non_empty)
    """The tracking store: ``http(s)://`` for a server, ``sqlite:///path.db`` for a local
    database; null: MLflow's own default (``MLFLOW_TRACKING_URI``, else its local store)."""
    experiment: str = attrs.field(default="nexrl", validator=non_empty)
    """Experiment the run goes to; created when missing."""
    artifact_location: str | None = attrs.field(default=None, validator=optional_non_empty)
    """Where an experiment this sink creates keeps its artifacts (the final model,
    ``config.yaml``); null: the tracking store's default (for a local database,
    ``./mlruns`` under the directory ``nexrl train`` runs in)."""
    run_name: str | None = attrs.field(default=None, validator=optional_non_empty)
    """Name of the run; null: the output directory's name."""
    tags: dict[str, str] = attrs.field(factory=dict)
    """Tags of the run."""


class MlflowSink:
    """One MLflow run per NexRL run, continued on ``--resume``."""

    def __init__(self, setup: SinkSetup) -> None:
        import_sdk("mlflow", "mlflow")
        from mlflow import MlflowClient
        from mlflow.entities import Param, RunStatus

        options: MlflowOptions = setup.options
        self.work_dir = setup.work_dir
        try:
            self.client: Any = MlflowClient(tracking_uri=options.tracking_uri)
            self.tracking_uri = self.client.tracking_uri
            experiment = self.client.get_experiment_by_name(options.experiment)
            experiment_id = (
                experiment.experiment_id
                if experiment
                else self.client.create_experiment(options.experiment, artifact_location=options.artifact_location)
            )
            previous = resumed_run(setup.work_dir, setup.resumed_from)
            if previous is not None:
                self.client.update_run(previous.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
                self.tracker = previous
            else:
                run = self.client.create_run(
                    experiment_id,
                    run_name=options.run_name or setup.run_name,
                    tags={**options.tags, "nexrl.output_dir": str(setup.output_dir.resolve())},
                )
                self.tracker = TrackerRun(run_id=run.info.run_id)
                params = [Param(key, value[:MAX_PARAM_CHARS]) for key, value in flat_config(setup.config).items()]
                for start in range(0, len(params), PARAMS_PER_CALL):
                    self.client.log_batch(self.tracker.run_id, params=params[start : start + PARAMS_PER_CALL])
            self.client.log_dict(self.tracker.run_id, setup.config, CONFIG_ARTIFACT)
        except Exception as error:  # noqa: BLE001 - every start failure refuses the run with what to fix
            raise SinkUnavailable(
                f"MLflow tracking store {options.tracking_uri or '(MLflow default)'!r} refused the run: "
                f"{type(error).__name__}: {error}. Set the sink's option tracking_uri to a reachable server "
                "(http://...) or a local database (sqlite:///path/mlflow.db)"
            ) from None
        self.experiment = options.experiment
        self.tracker.save(self.work_dir)

    def log(self, row: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric

        step = int(row["step"])
        if not self.tracker.is_new(step):
            return
        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in numbers_of(row).items()]
        self.client.log_batch(self.tracker.run_id, metrics=metrics)
        self.tracker = attrs.evolve(self.tracker, last_step=step)
        self.tracker.save(self.work_dir)

    def log_final_model(self, path: Path) -> None:
        self.client.log_artifacts(self.tracker.run_id, str(path), FINAL_MODEL_ARTIFACT)
        self.client.set_tag(self.tracker.run_id, "nexrl.final_model", str(path.resolve()))

    def close(self, outcome: RunOutcome) -> None:
        self.client.set_terminated(self.tracker.run_id, status=STATUS[outcome])

    def location(self) -> str:
        return f"run {self.tracker.run_id} of experiment {self.experiment!r} at {self.tracking_uri}"


@hookimpl
def nexrl_metrics_sinks() -> list[MetricsSinkSpec]:
    return [
        MetricsSinkSpec(
            name="mlflow",
            factory="nexrl_sinks.mlflow_sink:MlflowSink",
            config_class=MlflowOptions,
            description="An MLflow run on a tracking server or a local database; pip install 'nexrl[mlflow]'",
        )
    ]
