"""The core's pieces every backend over a service holder is built from (`HolderBackend`,
`build_trainer`, `HolderTrainerConfig`), on a small in-test holder."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest

from nexrl_core.config import ConfigError, load_config
from nexrl_core.config.schema import TeacherConfig
from nexrl_core.training.holder_backend import HolderBackend, recipe_path
from nexrl_core.training.holder_trainer import HolderTrainerConfig, loss_option_values
from nexrl_core.training.holders import HolderTarget, TrainStepConfig
from nexrl_core.training.trainer import build_trainer


@attrs.frozen(kw_only=True)
class CounterConfig(HolderTarget):
    refuse: tuple[str, ...] = ()


class CounterHolder:
    """A holder whose model is a step counter; checkpoints are its value."""

    def __init__(self, config: CounterConfig) -> None:
        self.config = config
        self.steps = 0
        self.sampling = -1
        self.closed = False

    def refused_options(self, config: TrainStepConfig) -> dict[str, str]:
        return {key: "not here" for key in self.config.refuse}

    def run_info(self) -> dict[str, str]:
        return {}

    def save_checkpoint(self, name: str) -> str:
        return f"counter://{name}/{self.steps}"

    def load_checkpoint(self, path: str) -> None:
        self.steps = int(path.rsplit("/", 1)[1])

    def update_sampling_weights(self, weight_path: str | None = None) -> str:
        self.sampling = self.steps
        return f"counter://sampling/{self.steps}"

    def close(self) -> None:
        self.closed = True


class StatefulTrainer:
    def __init__(self) -> None:
        self.train_step = TrainStepConfig()
        self.memory: dict[str, Any] = {"coef": 0.3}

    def train(self, holder: CounterHolder, trajectories: Sequence[Any], step: int) -> dict[str, float]:
        holder.steps += 1
        return {"steps": float(holder.steps)}

    def sync_weights(self, holder: CounterHolder, step: int) -> str | None:
        return holder.update_sampling_weights()

    def state(self) -> dict[str, Any]:
        return dict(self.memory)

    def load_state(self, state: dict[str, Any]) -> None:
        self.memory = dict(state)


def backend(tmp_path: Path, *refuse: str) -> tuple[HolderBackend, CounterHolder, StatefulTrainer]:
    from nexrl_core.config import ModelConfig

    holder = CounterHolder(CounterConfig(model=ModelConfig(name="m"), refuse=refuse))
    trainer = StatefulTrainer()
    closed: list[str] = []
    made = HolderBackend(holder, trainer, name="counter", work_dir=tmp_path, on_close=[lambda: closed.append("x")])  # type: ignore[arg-type]
    return made, holder, trainer


def test_a_checkpoint_restores_the_holder_the_trainer_state_and_sampling(tmp_path: Path) -> None:
    made, holder, trainer = backend(tmp_path)
    made.train([], 1)
    made.train([], 2)
    trainer.memory["coef"] = 0.7  # the trainer's state moved away from a new trainer's
    path = made.save_checkpoint("step_000002")
    assert Path(path).parent == tmp_path / "checkpoints"
    trainer.memory["coef"] = 9.0
    made.train([], 3)
    resumed, new_holder, new_trainer = backend(tmp_path)
    resumed.load_checkpoint(path)
    assert new_holder.steps == 2 and new_holder.sampling == 2 and new_trainer.memory == {"coef": 0.7}
    assert resumed.chat_model() is new_holder


def test_close_closes_the_holder_then_what_the_backend_started(tmp_path: Path) -> None:
    made, holder, _ = backend(tmp_path)
    made.close()
    assert holder.closed


@pytest.mark.parametrize(
    ("key", "path"),
    [
        ("loss_fn_config.agg_mode", "algorithm.loss.options.agg_mode"),
        ("optimizer.eps", "algorithm.eps"),
        ("model.dtype", "model.dtype"),
    ],
)
def test_refused_options_are_reported_with_their_recipe_key(tmp_path: Path, key: str, path: str) -> None:
    with pytest.raises(ConfigError) as caught:
        backend(tmp_path, key)
    assert caught.value.problems == [f"{path}: backend 'counter' cannot honour it: not here"]
    assert recipe_path(key) == path


def test_every_loss_option_travels_by_value() -> None:
    config = HolderTrainerConfig.from_recipe(
        load_config(
            None, ["algorithm.loss.name=ppo", "algorithm.loss.options.dual_clip_c=3", "algorithm.loss.options.agg_mode=seq-mean-token-sum"]
        )
    )
    assert config.train_step.loss_fn_config == {
        "clip_low": 0.2,
        "clip_high": 0.2,
        "dual_clip_c": 3.0,
        "agg_mode": "seq-mean-token-sum",
        "entropy_coeff": 0.0,
    }
    assert loss_option_values(None) == {}


@pytest.mark.parametrize(
    ("name", "through_transport", "fitting"),
    [("self_hosted_grpo", False, "a trainer that drives a service holder (remote_api_grpo)"),
     ("remote_api_grpo", True, "a trainer with capability 'transport' (self_hosted_grpo)")],
)  # fmt: skip
def test_build_trainer_refuses_a_trainer_that_does_not_fit_naming_those_that_do(name: str, through_transport: bool, fitting: str) -> None:
    with pytest.raises(ConfigError) as caught:
        build_trainer(load_config(None, []), name, "backend.options.trainer", through_transport=through_transport)
    assert caught.value.problems == [f"backend.options.trainer: trainer {name!r} does not fit this backend, which needs {fitting}"]


def test_build_trainer_configures_the_trainer_from_the_recipe_and_refuses_a_setting_it_lacks() -> None:
    recipe = load_config(None, ["algorithm.learning_rate=0.003"])
    trainer = build_trainer(recipe, "remote_api_grpo", "backend.options.trainer")
    assert trainer.train_step.optimizer.learning_rate == 0.003
    with pytest.raises(ConfigError, match=r"backend.options.x: trainer 'remote_api_grpo' has no setting 'x'"):
        build_trainer(recipe, "remote_api_grpo", "backend.options.trainer", settings={"x": ("backend.options.x", 1)})


class DistillingTrainer(StatefulTrainer):
    """A trainer whose recipe names a teacher (`HolderTrainerConfig.teacher`)."""

    def __init__(self, teacher: str) -> None:
        super().__init__()
        self.config = HolderTrainerConfig(teacher=TeacherConfig(model=teacher))


class TeacherCounterHolder(CounterHolder):
    def teacher_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        return [[0.0] * len(tokens) for tokens in sequences]


def test_a_teacher_is_refused_for_a_holder_that_scores_with_none(tmp_path: Path) -> None:
    from nexrl_core.config import ModelConfig

    config = CounterConfig(model=ModelConfig(name="m"), teacher="t")
    with pytest.raises(ConfigError) as caught:
        HolderBackend(CounterHolder(config), DistillingTrainer("t"), name="counter", work_dir=tmp_path)  # type: ignore[arg-type]
    (problem,) = caught.value.problems
    assert problem.startswith("teacher.model: backend 'counter' cannot honour it: its CounterHolder scores tokens under no second model")
    HolderBackend(TeacherCounterHolder(config), DistillingTrainer("t"), name="counter", work_dir=tmp_path)  # type: ignore[arg-type]
