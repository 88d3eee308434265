"""The shortened quickstart (the tiny model on NexRL's embedded Tinker service) reporting to
Weights & Biases (offline) and MLflow (a local SQLite tracking store), read back with
each tracker's own API: every step's reward and loss, the recipe, the final model.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from importlib.resources import as_file, files
from pathlib import Path
from typing import Any

import attrs
import pytest
import yaml

from nexrl_core.config import ConfigError, TrainConfig, dump_config, load_config
from nexrl_core.plugins.hookspecs import hookimpl
from nexrl_core.plugins.loading import load_plugins
from nexrl_core.plugins.registry import build_registry, reset_registry
from nexrl_core.plugins.specs import MetricsSinkSpec
from nexrl_core.run.loop import RunSummary, run_training
from nexrl_core.run.sinks import RunOutcome, SinkSetup
from nexrl_sinks.common import flat_config
from nexrl_sinks.testing import OfflineRun, read_offline_runs

pytestmark = pytest.mark.slow


def quickstart(out_dir: Path, *overrides: str) -> TrainConfig:
    """The built-in quickstart, two steps of four prompts, validated before and after."""
    with as_file(files("nexrl_core").joinpath("recipes", "quickstart.yaml")) as path:
        return load_config(
            path,
            [
                f"output.dir={out_dir}",
                "schedule.steps=2",
                "schedule.checkpoint_every=1",
                "schedule.validate_every=2",
                "task.val_size=4",
                "rollout.prompts_per_step=4",
                "rollout.group_size=4",
                *overrides,
            ],
        )


def sinks_override(*sinks: Mapping[str, Any] | str) -> str:
    return f"output.sinks={json.dumps(list(sinks))}"


def wandb_sink(wandb_dir: Path) -> dict[str, Any]:
    return {
        "name": "wandb",
        "options": {
            "project": "sinks-test",
            "entity": "nexrl-tests",
            "run_name": "short-quickstart",
            "tags": ["quickstart", "grpo"],
            "mode": "offline",
            "dir": str(wandb_dir),
        },
    }


def mlflow_store(base: Path) -> str:
    """A local SQLite tracking store in ``base`` (its artifacts go to ``base/artifacts``)."""
    return f"sqlite:///{base / 'mlflow.db'}"


def mlflow_sink(tracking_uri: str) -> dict[str, Any]:
    return {
        "name": "mlflow",
        "options": {
            "tracking_uri": tracking_uri,
            "experiment": "sinks-test",
            "artifact_location": str(Path(tracking_uri.removeprefix("sqlite:///")).with_name("artifacts")),
            "run_name": "short-quickstart",
            "tags": {"team": "rl"},
        },
    }


def read_rows(out_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def mlflow_run(tracking_uri: str) -> Any:
    """The one run of the test experiment, as MLflow's client returns it."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    experiment = client.get_experiment_by_name("sinks-test")
    (run,) = client.search_runs([experiment.experiment_id])
    return run


def mlflow_history(tracking_uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow import MlflowClient

    history = MlflowClient(tracking_uri=tracking_uri).get_metric_history(run_id, key)
    return sorted((metric.step, metric.value) for metric in history)


def expected(rows: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(row["step"], row[key]) for row in rows if row.get(key) is not None]


@attrs.frozen
class Run:
    config: TrainConfig
    summary: RunSummary
    tracking_uri: str
    wandb_dir: Path

    @property
    def out_dir(self) -> Path:
        return Path(self.config.output.dir)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    base = tmp_path_factory.mktemp("sinks")
    tracking_uri = mlflow_store(base)
    wandb_dir = base / "wandb-files"
    config = quickstart(base / "run", sinks_override("tensorboard", wandb_sink(wandb_dir), mlflow_sink(tracking_uri)))
    return Run(config, run_training(config, progress_bar=False), tracking_uri, wandb_dir)


def the_wandb_run(run: Run) -> OfflineRun:
    (offline,) = read_offline_runs(run.wandb_dir / "wandb")
    return offline


def test_wandb_offline_run_holds_every_step_the_recipe_and_the_final_model(run: Run) -> None:
    rows = read_rows(run.out_dir)
    offline = the_wandb_run(run)
    assert (offline.project, offline.name, offline.tags) == ("sinks-test", "short-quickstart", ("quickstart", "grpo"))
    assert [row["_step"] for row in offline.history] == [row["step"] for row in rows] == [0, 1, 2]
    assert [step for step, _ in expected(rows, "train/loss")] == [1, 2], "every step trains (no group all of one reward)"
    logged = {row["_step"]: row for row in offline.history}
    for key in ("reward/mean", "train/loss", "val/reward/mean"):
        assert [(step, logged[step][key]) for step, _ in expected(rows, key)] == expected(rows, key), key
    assert {key: value for key, value in offline.config.items() if key != "_wandb"} == dump_config(run.config)
    assert offline.summary["final_model"] == str(run.out_dir / "final_model")
    assert run.summary.sinks["wandb"].startswith(str(run.wandb_dir / "wandb" / "offline-run-"))


def test_mlflow_run_holds_every_step_the_recipe_and_the_final_model(run: Run) -> None:
    from mlflow import MlflowClient

    rows = read_rows(run.out_dir)
    tracked = mlflow_run(run.tracking_uri)
    run_id = tracked.info.run_id
    assert tracked.info.run_name == "short-quickstart" and tracked.info.status == "FINISHED"
    assert tracked.data.tags["team"] == "rl"
    for key in ("reward/mean", "train/loss", "val/reward/mean"):
        assert mlflow_history(run.tracking_uri, run_id, key) == expected(rows, key), key
    assert tracked.data.params == flat_config(dump_config(run.config))
    client = MlflowClient(tracking_uri=run.tracking_uri)
    recipe = Path(client.download_artifacts(run_id, "config.yaml", str(run.out_dir.parent / "downloaded")))
    assert yaml.safe_load(recipe.read_text()) == dump_config(run.config)
    model_files = {Path(info.path).name for info in client.list_artifacts(run_id, "final_model")}
    assert tracked.info.artifact_uri.startswith(str(run.out_dir.parent / "artifacts")), "where the option put them"
    assert model_files == {path.name for path in (run.out_dir / "final_model").iterdir()}
    assert "model.safetensors" in model_files
    assert tracked.data.tags["nexrl.final_model"] == str((run.out_dir / "final_model").resolve())
    assert run.summary.sinks["mlflow"] == f"run {run_id} of experiment 'sinks-test' at {run.tracking_uri}"


def test_tensorboard_stays_beside_the_trackers(run: Run) -> None:
    assert list((run.out_dir / "sinks" / "tensorboard").glob("events.out.tfevents.*"))
    assert list(run.summary.sinks) == ["tensorboard", "wandb", "mlflow"]


# --- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sink", "message"),
    [
        (
            {"name": "mlflow", "options": {"tracking_uri": "nosuch://tracking", "experiment": "x"}},
            "output.sinks[0]: metrics sink 'mlflow' could not start: MLflow tracking store 'nosuch://tracking' refused the run",
        ),
        ({"name": "wandb", "options": {"mode": "sideways"}}, "output.sinks[0].options.mode: 'sideways' is not one of: offline, online"),
        ({"name": "wandb", "options": {"projekt": "x"}}, "output.sinks[0].options.projekt: unknown key; did you mean 'project'?"),
        ("wandbb", "output.sinks[0].name: unknown metrics sink 'wandbb'"),
    ],
    ids=["unreachable-store", "bad-mode", "unknown-option", "unknown-sink"],
)
def test_a_broken_sink_is_refused_before_step_1(tmp_path: Path, sink: Any, message: str) -> None:
    out_dir = tmp_path / "run"
    with pytest.raises(ConfigError) as refused:
        run_training(quickstart(out_dir, sinks_override(sink)), progress_bar=False)
    assert message in str(refused.value)
    assert not out_dir.exists(), "a run refused before step 1 leaves nothing behind"


def test_a_missing_tracker_package_is_refused_with_the_extra_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # as if wandb were not installed
    with pytest.raises(ConfigError) as refused:
        run_training(quickstart(tmp_path / "run", sinks_override(wandb_sink(tmp_path))), progress_bar=False)
    assert "the wandb package is not installed" in str(refused.value)
    assert "pip install 'nexrl[wandb]'" in str(refused.value)


def test_wandb_online_without_an_api_key_is_refused_with_what_to_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc from a `wandb login`
    online = wandb_sink(tmp_path)
    online["options"]["mode"] = "online"
    with pytest.raises(ConfigError) as refused:
        run_training(quickstart(tmp_path / "run", sinks_override(online)), progress_bar=False)
    message = str(refused.value)
    assert "output.sinks[0]: metrics sink 'wandb' could not start: wandb.init failed" in message
    assert "set WANDB_API_KEY (or run `wandb login`)" in message and "mode: offline" in message
    assert not (tmp_path / "run").exists()


# --- a sink failing mid-run ------------------------------------------------------------------------


class FailingSink:
    """A third party's sink whose tracker goes away after step 1."""

    def __init__(self, setup: SinkSetup) -> None:
        self.calls = 0

    def log(self, row: Mapping[str, Any]) -> None:
        if row["step"] >= 2:
            raise ConnectionError("tracker went away")

    def log_final_model(self, path: Path) -> None:
        raise AssertionError("a sink turned off is not called again")

    def close(self, outcome: RunOutcome) -> None:
        raise AssertionError("a sink turned off is not called again")

    def location(self) -> str:
        return "somewhere"


class FailingSinkPlugin:
    @hookimpl
    def nexrl_metrics_sinks(self) -> list[MetricsSinkSpec]:
        return [MetricsSinkSpec(name="acme.failing", factory=FailingSink)]


@pytest.fixture
def failing_sink_installed() -> Iterator[None]:
    reset_registry(build_registry(load_plugins(extra={"acme_failing_sink": FailingSinkPlugin()})))
    yield
    reset_registry()


def test_a_sink_raising_mid_run_is_reported_once_and_the_run_finishes(
    tmp_path: Path, failing_sink_installed: None, caplog: pytest.LogCaptureFixture
) -> None:
    tracking_uri = mlflow_store(tmp_path)
    config = quickstart(tmp_path / "run", "schedule.steps=3", sinks_override("acme.failing", mlflow_sink(tracking_uri)))
    with caplog.at_level(logging.WARNING, logger="nexrl.train"):
        summary = run_training(config, progress_bar=False)
    assert summary.steps == 3 and summary.final_model is not None
    warnings = [record.getMessage() for record in caplog.records if "acme.failing" in record.getMessage()]
    assert warnings == [
        "metrics sink 'acme.failing' failed at step 2 and is off for the rest of this run: ConnectionError: tracker went away"
    ]
    assert summary.sinks["acme.failing"] == "turned off at step 2: ConnectionError: tracker went away"
    tracked = mlflow_run(tracking_uri)
    assert tracked.info.status == "FINISHED"
    assert [step for step, _ in mlflow_history(tracking_uri, tracked.info.run_id, "reward/mean")] == [1, 2, 3]


# --- resume ---------------------------------------------------------------------------------------


def test_resume_continues_the_same_tracker_runs(tmp_path: Path) -> None:
    tracking_uri = mlflow_store(tmp_path)
    sinks = sinks_override(wandb_sink(tmp_path / "wandb-files"), mlflow_sink(tracking_uri))
    run_training(quickstart(tmp_path / "run", sinks), progress_bar=False)
    first = mlflow_run(tracking_uri)

    summary = run_training(quickstart(tmp_path / "run", sinks, "schedule.steps=3"), resume=True, progress_bar=False)
    assert summary.steps == 3
    rows = read_rows(tmp_path / "run")
    resumed = mlflow_run(tracking_uri)  # still the only run of the experiment
    assert resumed.info.run_id == first.info.run_id and resumed.info.status == "FINISHED"
    assert mlflow_history(tracking_uri, resumed.info.run_id, "reward/mean") == expected(rows, "reward/mean")
    assert [step for step, _ in mlflow_history(tracking_uri, resumed.info.run_id, "train/loss")] == [1, 2, 3]

    before, after = read_offline_runs(tmp_path / "wandb-files" / "wandb")  # one folder per process, one W&B run
    assert before.run_id == after.run_id
    assert [row["_step"] for row in before.history] == [0, 1, 2]
    assert [row["_step"] for row in after.history] == [3]
    assert after.history[0]["reward/mean"] == rows[-1]["reward/mean"]
    assert after.summary["final_model"] == str(tmp_path / "run" / "final_model")


def test_a_resumed_tracker_run_gets_no_step_twice(tmp_path: Path) -> None:
    """The interrupted process sent steps 1-3, its last checkpoint was step 1: the resumed
    process sends 2 and 3 again, and the tracker keeps the first of each."""
    from nexrl_core.config.components import resolve_choice_list
    from nexrl_core.plugins.registry import find_spec

    tracking_uri = mlflow_store(tmp_path)
    config = quickstart(tmp_path / "run", sinks_override(wandb_sink(tmp_path / "wandb-files"), mlflow_sink(tracking_uri)))
    chosen = resolve_choice_list("metrics_sinks", config.output.sinks, "output.sinks")

    def open_all(resumed_from: int | None) -> list[Any]:
        sinks = []
        for choice in chosen:
            work_dir = tmp_path / "run" / "sinks" / choice.name
            work_dir.mkdir(parents=True, exist_ok=True)
            setup = SinkSetup(
                recipe=config, options=choice.options, output_dir=tmp_path / "run", work_dir=work_dir, resumed_from=resumed_from
            )
            sinks.append(find_spec("metrics_sinks", choice.name).open(setup))
        return sinks

    for sink in open_all(None):
        for step in (1, 2, 3):
            sink.log({"step": step, "reward/mean": step / 10})
        sink.close(RunOutcome.INTERRUPTED)
    for sink in open_all(1):
        for step in (2, 3, 4):
            sink.log({"step": step, "reward/mean": step / 100})
        sink.close(RunOutcome.FINISHED)

    tracked = mlflow_run(tracking_uri)
    assert mlflow_history(tracking_uri, tracked.info.run_id, "reward/mean") == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.04)]
    before, after = read_offline_runs(tmp_path / "wandb-files" / "wandb")
    assert before.run_id == after.run_id
    assert [(row["_step"], row["reward/mean"]) for row in before.history + after.history] == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.04)]
