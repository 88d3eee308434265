"""``remote_api_grpo``: registration, advantages, datum conversion and what is sent to the holder."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Sequence

import pluggy
import pytest
from nexrl_grpo import plugin
from nexrl_grpo.trainers import RemoteApiGrpoTrainer

from nexrl_core import hookspecs
from nexrl_core.config import load_config
from nexrl_core.holders import TrainStepConfig
from nexrl_core.trainer import RemoteApiTrainerConfig, sort_trajectories
from nexrl_core.types import RemoteDatum, Trajectory


def trainer_specs() -> list:
    manager = pluggy.PluginManager(hookspecs.PROJECT)
    manager.add_hookspecs(hookspecs)
    manager.register(plugin)
    return [spec for specs in manager.hook.nexrl_trainers() for spec in specs]


def trajectory(group: str, run: int, reward: float, prompt: int = 2, response: int = 3, index: int = 0) -> Trajectory:
    tokens = list(range(1, prompt + response + 1))
    return Trajectory(
        tokens=tokens,
        loss_mask=[0] * prompt + [1] * response,
        logprobs=[0.0] * prompt + [-0.5] * response,
        reward=reward,
        group_id=group,
        run_id=run,
        task_id=group,
        extra={"trajectory_index": index},
    )


class RecordingHolder:
    def __init__(self) -> None:
        self.calls: list[tuple[list[RemoteDatum], TrainStepConfig]] = []
        self.synced = 0

    def train(self, datums: Sequence[RemoteDatum], config: TrainStepConfig) -> dict[str, float]:
        self.calls.append((list(datums), config))
        return {"loss": 0.25, "train/approx_kl": 0.01, "note": "ignored"}  # type: ignore[dict-item]

    def update_sampling_weights(self, weight_path: str | None = None) -> str:
        self.synced += 1
        return f"w{self.synced}"


def test_the_trainer_is_registered_lazily() -> None:
    (spec,) = trainer_specs()
    assert spec.name == "remote_api_grpo" and spec.factory == "nexrl_grpo.trainers:RemoteApiGrpoTrainer"
    assert spec.config_class is RemoteApiTrainerConfig
    assert isinstance(spec.build(), RemoteApiGrpoTrainer)
    code = "import sys, nexrl_grpo.plugin\nassert not {'torch', 'numpy'} & set(sys.modules)\n"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_config_from_the_recipe() -> None:
    config = RemoteApiTrainerConfig.from_recipe(
        load_config(
            None,
            [
                "algorithm.weight_decay=0.2",
                "algorithm.grad_clip_norm=0.5",
                "algorithm.advantage.options.norm_by_std=false",
            ],
        )
    )
    assert config.advantage.name == "grpo" and config.advantage_options.norm_by_std is False
    assert config.train_step.weight_decay == 0.2 and config.train_step.grad_clip_norm == 0.5
    assert config.train_step.loss_fn == "importance_sampling"
    assert config.train_step.loss_fn_config == {"entropy_coeff": 0.0}


def test_datums_shift_tokens_and_mask_advantages_and_uniform_groups_are_skipped() -> None:
    trainer = RemoteApiGrpoTrainer(RemoteApiTrainerConfig())
    holder = RecordingHolder()
    batch = [
        trajectory("b", 1, 1.0),
        trajectory("a", 0, 1.0, prompt=1),
        trajectory("b", 0, 1.0),
        trajectory("a", 1, 0.0, response=1),
    ]
    metrics = trainer.train(holder, batch, step=1)
    assert metrics["datums/trained"] == 2 and metrics["datums/skipped"] == 2
    assert metrics["grpo/groups"] == 2 and metrics["grpo/uniform_reward_fraction"] == 0.5
    assert metrics["train/loss"] == 0.25 and metrics["train/approx_kl"] == 0.01 and "train/note" not in metrics
    ((winner, loser), step_config) = holder.calls[0]
    assert step_config == TrainStepConfig()
    # group "a": run 0 scored 1, run 1 scored 0, so GRPO gives them +A and -A
    assert winner.input_tokens == [1, 2, 3] and winner.target_tokens == [2, 3, 4]
    assert winner.loss_mask == [1.0, 1.0, 1.0] and winner.sampling_logprobs == [-0.5, -0.5, -0.5]
    assert loser.input_tokens == [1, 2] and loser.target_tokens == [2, 3]
    assert loser.loss_mask == [0.0, 1.0] and loser.sampling_logprobs == [0.0, -0.5]
    advantage = winner.advantages[0]
    assert advantage > 0 and winner.advantages == [advantage] * 3
    assert loser.advantages == [0.0, pytest.approx(-advantage)]
    assert trainer.sync_weights(holder, 1) == "w1"


def test_nothing_to_learn_sends_nothing_and_syncs_nothing() -> None:
    trainer = RemoteApiGrpoTrainer()
    holder = RecordingHolder()
    metrics = trainer.train(holder, [trajectory("a", 0, 1.0), trajectory("a", 1, 1.0), trajectory("b", 0, 0.0)], step=1)
    assert metrics["datums/trained"] == 0 and metrics["datums/skipped"] == 3
    assert metrics["grpo/single_run_groups"] == 1
    assert all(math.isfinite(value) for value in metrics.values())
    assert holder.calls == [] and trainer.sync_weights(holder, 1) is None


def test_order_of_arrival_does_not_change_what_is_sent() -> None:
    batch = [
        trajectory(g, r, float((r + len(g)) % 2), index=i) for g in ("x", "yy") for r in range(3) for i in range(2)
    ]
    sent = []
    for order in (batch, batch[::-1], batch[3:] + batch[:3]):
        holder = RecordingHolder()
        RemoteApiGrpoTrainer().train(holder, order, step=1)
        sent.append(holder.calls[0][0])
    assert sent[0] == sent[1] == sent[2]
    assert sort_trajectories(batch[::-1]) == sort_trajectories(batch)


def test_tinker_style_metric_names_get_plain_aliases() -> None:
    class TinkerLike(RecordingHolder):
        def train(self, datums, config):  # noqa: ANN001, ANN201
            return {"loss:sum": 6.0, "num_tokens:sum": 3.0, "approx_kl:mean": 0.5, "clip_fraction:mean": 0.25}

    metrics = RemoteApiGrpoTrainer().train(TinkerLike(), [trajectory("a", 0, 1.0), trajectory("a", 1, 0.0)], step=1)
    assert metrics["train/loss"] == 2.0 and metrics["train/loss:sum"] == 6.0
    assert metrics["train/approx_kl"] == 0.5 and metrics["train/clip_fraction"] == 0.25
