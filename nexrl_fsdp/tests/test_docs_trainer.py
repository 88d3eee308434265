"""The custom self-hosted trainer `docs/plugins.md` shows, taken from the page as written:
the self-hosted backend configures it from the recipe, and each update it sends the
workers carries the step's scheduled learning rate; a trainer whose config cannot hold a
schedule is refused by key instead of training at a constant rate."""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Callable
from importlib.resources import as_file, files
from pathlib import Path
from typing import Any

import attrs
import pytest

from nexrl_core.config import TrainConfig, load_config
from nexrl_core.config.components import resolve_options
from nexrl_core.config.errors import ConfigError
from nexrl_core.config.lr_schedule import scheduled_learning_rate
from nexrl_core.plugins.hookspecs import hookimpl
from nexrl_core.plugins.specs import TrainerSpec
from nexrl_core.training.backend import BackendSetup
from nexrl_core.training.holders import TrainStepConfig
from nexrl_core.training.self_hosted import TRANSPORT_TRAINER, UpdateSettings
from nexrl_fsdp.selfhosted.backend import _check

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"
STEPS, WARMUP, RATE = 6, 2, 0.01


def example_package(into: Path) -> Path:
    """The page's ``acme_algos`` files (the python block that defines ``MeanBaselineTrainer``,
    split at its ``# acme_algos/<file>.py`` lines), written as a package under ``into``."""
    (block,) = [block for block in re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S) if "class MeanBaselineTrainer" in block]
    package = into / "acme_algos"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    parts = re.split(r"^# acme_algos/(\w+\.py)\n", block, flags=re.M)
    for name, text in zip(parts[1::2], parts[2::2], strict=True):
        (package / name).write_text(text)
    assert sorted(path.name for path in package.iterdir()) == ["__init__.py", "plugin.py", "trainer.py"]
    return into


def recipe(tmp_path: Path, *overrides: str) -> TrainConfig:
    with as_file(files("nexrl_core").joinpath("recipes", "quickstart.yaml")) as path:
        return load_config(
            path,
            [
                f"output.dir={tmp_path / 'run'}", "backend.name=self-hosted", f"schedule.steps={STEPS}",
                f"algorithm.learning_rate={RATE}", *overrides,
            ],
        )  # fmt: skip


def checked(config: TrainConfig, tmp_path: Path) -> Any:
    setup = BackendSetup(recipe=config, options=resolve_options("backends", config.backend, "backend"), work_dir=tmp_path / "backend")
    return _check(setup, setup.options)


@pytest.fixture
def docs_trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, register_nexrl_plugin: Callable[[Any, str], Any]) -> str:
    monkeypatch.syspath_prepend(str(example_package(tmp_path / "src")))
    for name in [name for name in sys.modules if name.split(".")[0] == "acme_algos"]:  # the previous test's copy
        monkeypatch.delitem(sys.modules, name)
    register_nexrl_plugin(importlib.import_module("acme_algos.plugin"), "acme_algos")
    return "acme.mean_baseline"


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_the_docs_trainer_sends_each_steps_scheduled_rate(tmp_path: Path, docs_trainer: str, schedule: str) -> None:
    config = recipe(
        tmp_path, f"backend.options.trainer={docs_trainer}", f"algorithm.lr_schedule={schedule}", f"algorithm.warmup_steps={WARMUP}",
        "algorithm.loss.name=ppo", "algorithm.loss.options={clip_low: 0.1}", "backend.options.update={ppo_epochs: 2}",
    )  # fmt: skip
    trainer = checked(config, tmp_path)
    try:
        sent = [trainer.update_options(step) for step in range(1, STEPS + 1)]
    finally:
        trainer.close()
    expected = [
        scheduled_learning_rate(RATE, step, schedule=schedule, warmup_steps=WARMUP, total_steps=STEPS) for step in range(1, STEPS + 1)
    ]
    assert len(set(expected)) >= STEPS - 1, f"the schedule must move the rate: {expected}"
    assert [options["optimizer"]["learning_rate"] for options in sent] == pytest.approx(expected)
    assert all(options["loss_fn_config"]["clip_low"] == 0.1 and options["ppo_epochs"] == 2 for options in sent)


@attrs.frozen(kw_only=True)
class ScheduleLessConfig:
    """A trainer config with only the loss and update fields (no ``lr_schedule``)."""

    train_step: TrainStepConfig = attrs.field(factory=TrainStepConfig)
    update: UpdateSettings = attrs.field(factory=UpdateSettings)


class ScheduleLessPlugin:
    @hookimpl
    def nexrl_trainers(self) -> list[TrainerSpec]:
        return [
            TrainerSpec(
                name="acme.schedule_less",
                factory="acme_algos.trainer:MeanBaselineTrainer",
                config_class=ScheduleLessConfig,
                capabilities={TRANSPORT_TRAINER},
            )  # fmt: skip
        ]


def test_a_schedule_for_a_trainer_that_cannot_hold_one_is_refused_by_key(
    tmp_path: Path, docs_trainer: str, register_nexrl_plugin: Callable[[Any, str], Any]
) -> None:
    register_nexrl_plugin(ScheduleLessPlugin(), "schedule_less")
    checked(recipe(tmp_path, "backend.options.trainer=acme.schedule_less"), tmp_path).close()  # a constant rate is what it does
    with pytest.raises(ConfigError) as refused:
        checked(recipe(tmp_path, "backend.options.trainer=acme.schedule_less", "algorithm.warmup_steps=2"), tmp_path)
    assert refused.value.problems == [
        "algorithm.warmup_steps: trainer 'acme.schedule_less' has no setting 'lr_schedule'; remove it or pick another trainer"
    ]
