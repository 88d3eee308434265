"""``remote_api_grpo``: registration, advantages, datum conversion and what is sent to the holder;
``self_hosted_grpo``: the same rows sent to the workers."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Sequence

import pluggy
import pytest

from nexrl_core.config import load_config
from nexrl_core.config.adamw import AdamWSettings
from nexrl_core.plugins import hookspecs
from nexrl_core.training.batch import Batch
from nexrl_core.training.holder_trainer import HolderTrainerConfig
from nexrl_core.training.holders import TrainStepConfig
from nexrl_core.training.self_hosted import UpdateSettings
from nexrl_core.types import RemoteDatum, Trajectory, sort_trajectories
from nexrl_grpo import plugin
from nexrl_grpo.config import SelfHostedGrpoConfig
from nexrl_grpo.trainers import HolderGrpoTrainer, SelfHostedGrpoTrainer


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

    def reference_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """A reference that gives every token logprob -1.0 (the samples have -0.5)."""
        return [[0.0] + [-1.0] * (len(tokens) - 1) for tokens in sequences]


def kl_trainer(*overrides: str) -> HolderGrpoTrainer:
    return HolderGrpoTrainer(HolderTrainerConfig.from_recipe(load_config(None, list(overrides))))


def test_kl_in_the_reward_separates_runs_of_equal_outcome_by_their_kl() -> None:
    trainer = kl_trainer("algorithm.kl.coef=0.5")
    holder = RecordingHolder()
    # equal outcome rewards; run 1 is longer, so it carries more KL (0.5 per trained token)
    metrics = trainer.train(holder, [trajectory("g", 0, 1.0, response=2), trajectory("g", 1, 1.0, response=4)], step=1)
    assert metrics["kl/mean"] == pytest.approx(0.5) and metrics["kl/coef"] == 0.5
    ((datums, _),) = holder.calls
    by_length = {len(datum.input_tokens): datum for datum in datums}
    short, long = by_length[3], by_length[5]
    # returns 1 - 0.5*0.5*2 = 0.5 and 1 - 0.5*0.5*4 = 0.0: the shorter run is the better one
    assert max(short.advantages) > 0 > min(long.advantages)


def test_without_kl_equal_outcomes_teach_nothing() -> None:
    holder = RecordingHolder()
    metrics = kl_trainer().train(holder, [trajectory("g", 0, 1.0, response=2), trajectory("g", 1, 1.0, response=4)], 1)
    assert holder.calls == [] and "kl/mean" not in metrics


@pytest.mark.parametrize(("penalty", "per_token"), [("kl", 0.5), ("abs", 0.5), ("mse", 0.125), ("low_var_kl", math.exp(-0.5) - 0.5)])
def test_each_penalty_reaches_the_reward(penalty: str, per_token: float) -> None:
    trainer = kl_trainer("algorithm.kl.coef=0.1", f"algorithm.kl.penalty={penalty}")
    metrics = trainer.train(RecordingHolder(), [trajectory("g", 0, 1.0), trajectory("g", 1, 0.0)], step=1)
    assert metrics["kl/mean"] == pytest.approx(per_token)


def test_the_adaptive_controller_moves_the_coefficient_towards_the_target_and_resumes() -> None:
    batch = [trajectory("g", 0, 1.0), trajectory("g", 1, 0.0)]  # measured KL 0.5 per token
    above = kl_trainer("algorithm.kl.coef=0.2", "algorithm.kl.controller=adaptive", "algorithm.kl.target=0.1",
                       "algorithm.kl.horizon=10")  # fmt: skip
    below = kl_trainer("algorithm.kl.coef=0.2", "algorithm.kl.controller=adaptive", "algorithm.kl.target=5",
                       "algorithm.kl.horizon=10")  # fmt: skip
    fixed = kl_trainer("algorithm.kl.coef=0.2")
    for step in (1, 2):
        for trainer in (above, below, fixed):
            trainer.train(RecordingHolder(), batch, step)
    # KL above target raises the coefficient, below lowers it (by at most 20% x n/horizon a step)
    assert above.state()["kl_coef"] == pytest.approx(0.2 * 1.04**2)
    assert below.state()["kl_coef"] == pytest.approx(0.2 * 0.96**2)
    assert fixed.state()["kl_coef"] == 0.2
    restored = kl_trainer("algorithm.kl.coef=0.2", "algorithm.kl.controller=adaptive", "algorithm.kl.target=0.1",
                          "algorithm.kl.horizon=10")  # fmt: skip
    restored.load_state(above.state())
    assert restored.train(RecordingHolder(), batch, 3)["kl/coef"] == pytest.approx(0.2 * 1.04**2)


def test_the_trainer_is_registered_lazily() -> None:
    specs = {spec.name: spec for spec in trainer_specs()}
    assert sorted(specs) == ["remote_api_grpo", "self_hosted_grpo"]
    spec = specs["remote_api_grpo"]
    assert spec.name == "remote_api_grpo" and spec.factory == "nexrl_grpo.trainers:HolderGrpoTrainer"
    assert spec.config_class is HolderTrainerConfig
    assert isinstance(spec.build(), HolderGrpoTrainer)
    code = "import sys, nexrl_grpo.plugin\nassert not {'torch', 'numpy'} & set(sys.modules)\n"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_config_from_the_recipe() -> None:
    adamw = ("learning_rate=0.001", "beta1=0.8", "beta2=0.99", "eps=1e-6", "weight_decay=0.2", "grad_clip_norm=0.5")
    estimator = "algorithm.advantage={name: reinforce_plus_plus, options: {gamma: 0.5}}"
    config = HolderTrainerConfig.from_recipe(load_config(None, [*(f"algorithm.{setting}" for setting in adamw), estimator]))
    assert config.advantage.name == "reinforce_plus_plus" and config.advantage_options.gamma == 0.5
    assert config.train_step.optimizer == AdamWSettings(
        learning_rate=0.001, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.2, grad_clip_norm=0.5
    )
    assert config.train_step.loss_fn == "importance_sampling"
    assert config.train_step.loss_fn_config == {"agg_mode": "token-mean", "entropy_coeff": 0.0}


def test_datums_shift_tokens_and_mask_advantages_and_uniform_groups_are_skipped() -> None:
    trainer = HolderGrpoTrainer(HolderTrainerConfig())
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
    trainer = HolderGrpoTrainer()
    holder = RecordingHolder()
    metrics = trainer.train(holder, [trajectory("a", 0, 1.0), trajectory("a", 1, 1.0), trajectory("b", 0, 0.0)], step=1)
    assert metrics["datums/trained"] == 0 and metrics["datums/skipped"] == 3
    assert metrics["grpo/single_run_groups"] == 1
    assert all(math.isfinite(value) for value in metrics.values())
    assert holder.calls == [] and trainer.sync_weights(holder, 1) is None


def test_order_of_arrival_does_not_change_what_is_sent() -> None:
    batch = [trajectory(g, r, float((r + len(g)) % 2), index=i) for g in ("x", "yy") for r in range(3) for i in range(2)]
    sent = []
    for order in (batch, batch[::-1], batch[3:] + batch[:3]):
        holder = RecordingHolder()
        HolderGrpoTrainer().train(holder, order, step=1)
        sent.append(holder.calls[0][0])
    assert sent[0] == sent[1] == sent[2]
    assert sort_trajectories(batch[::-1]) == sort_trajectories(batch)


def test_tinker_style_metric_names_get_plain_aliases() -> None:
    class TinkerLike(RecordingHolder):
        def train(self, datums, config):  # noqa: ANN001, ANN201
            return {"loss:sum": 6.0, "num_tokens:sum": 3.0, "approx_kl:mean": 0.5, "clip_fraction:mean": 0.25}

    metrics = HolderGrpoTrainer().train(TinkerLike(), [trajectory("a", 0, 1.0), trajectory("a", 1, 0.0)], step=1)
    assert metrics["train/loss"] == 2.0 and metrics["train/loss:sum"] == 6.0
    assert metrics["train/approx_kl"] == 0.5 and metrics["train/clip_fraction"] == 0.25


class RecordingTransport:
    """The workers' side of a step, recorded: each batch `update_actor` was sent."""

    def __init__(self) -> None:
        self.updates: list[Batch] = []

    def update_actor(self, batch: Batch, options: dict) -> dict[str, float]:
        self.updates.append(batch)
        return {"loss": 0.25}


def self_hosted_trainer(world_size: int, mini_batches: int = 1) -> tuple[SelfHostedGrpoTrainer, RecordingTransport]:
    config = SelfHostedGrpoConfig(recompute_old_logprobs=False, update=UpdateSettings(mini_batches=mini_batches))
    trainer, transport = SelfHostedGrpoTrainer(config), RecordingTransport()
    trainer.bind(transport, world_size=world_size, pad_token_id=0)  # type: ignore[arg-type]
    return trainer, transport


def rows_sent(batch: Batch) -> list[tuple[list[int], list[float]]]:
    """Each real row of a batch sent to the workers: its tokens, and the advantage of each
    token as the prediction of that token from the ones before it."""
    rows = []
    for row in batch.tensors["valid_rows"].nonzero().flatten().tolist():
        attended = batch.tensors["attention_mask"][row].bool()
        rows.append((batch.tensors["input_ids"][row][attended].tolist(), batch.tensors["advantages"][row][attended].tolist()))
    return rows


MIXED_STEP = [
    trajectory(group, run, reward, prompt=2 + len(group), index=run)
    for group, rewards in (("a", (1.0, 0.0, 1.0)), ("bb", (1.0, 1.0, 1.0)), ("ccc", (0.0, 0.5, 0.0)), ("dddd", (0.0, 0.0, 0.0)))
    for run, reward in enumerate(rewards)
]
"""Four groups of three runs, two of them uniform (nothing to learn from), prompts of different lengths."""


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_the_workers_train_the_rows_the_remote_trainer_sends(world_size: int) -> None:
    holder = RecordingHolder()
    remote = HolderGrpoTrainer().train(holder, MIXED_STEP, step=1)
    trainer, transport = self_hosted_trainer(world_size)
    metrics = trainer.train(MIXED_STEP, step=1)
    ((sent,),) = [transport.updates]
    ((datums, _),) = holder.calls
    assert sent.batch_size % world_size == 0
    expected = [(datum.input_tokens + datum.target_tokens[-1:], [0.0, *datum.advantages]) for datum in datums]
    assert [tokens for tokens, _ in rows_sent(sent)] == [tokens for tokens, _ in expected]
    assert [advantages for _, advantages in rows_sent(sent)] == [pytest.approx(values, abs=1e-6) for _, values in expected]
    assert sent.tensors["attention_mask"].any(dim=0).all(), "the columns only left-out rows used are gone"
    for name in ("datums/trained", "datums/skipped", "datums/trained_tokens"):
        assert metrics[name] == remote[name], name
    assert (metrics["datums/trained"], metrics["datums/skipped"]) == (6, 6)
    assert trainer.trained_since_publish


def test_workers_run_no_update_when_no_row_has_a_gradient() -> None:
    trainer, transport = self_hosted_trainer(2)
    metrics = trainer.train([trajectory("a", 0, 1.0), trajectory("a", 1, 1.0), trajectory("b", 0, 0.0)], step=1)
    assert (metrics["datums/trained"], metrics["datums/skipped"], metrics["datums/trained_tokens"]) == (0, 3, 0)
    assert transport.updates == [] and not trainer.trained_since_publish


def test_rows_too_few_for_every_ranks_mini_batches_train_whole() -> None:
    """Six rows with a gradient cannot give 2 ranks 4 mini-batches each: the whole step is
    trained, as the update needs, rather than failing the run."""
    trainer, transport = self_hosted_trainer(2, mini_batches=4)
    metrics = trainer.train(MIXED_STEP, step=1)
    assert transport.updates[0].batch_size == len(MIXED_STEP) and metrics["datums/skipped"] == 0
