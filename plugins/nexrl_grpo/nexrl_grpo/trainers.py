"""The GRPO trainers: ``remote_api_grpo`` on a service holder, ``self_hosted_grpo`` on FSDP workers.

Both share GRPO's group bookkeeping (`group_metrics`), KL in the reward
(`nexrl_grpo.kl.KLInReward`) and the registry's advantage estimators; they differ in
where the numbers live (per-trajectory lists for datums, a padded `Batch` for workers).

``remote_api_grpo``: the holder trainer (`HolderTrainer`) with GRPO's group bookkeeping and KL in the reward.

Advantages come from the recipe's estimator (``grpo`` by default) through the registry;
this flavour adds the numbers that tell whether GRPO has anything to learn from: how
many groups there were and which fraction had all runs score the same (those get
advantage 0 and are skipped, so a run where every group is uniform stops learning).

With ``algorithm.kl.coef > 0`` it applies the KL penalty in the reward, as the
original NexRL trainer and verl do: per trained token, ``reward -= beta * kl`` where
``kl`` is the recipe's penalty (``kl``, ``abs``, ``mse``, ``low_var_kl``) between the
sampler's logprobs and the reference model's (the base weights, from
`ServiceHolder.reference_logprobs`); group-relative estimators then compare runs by
their shaped returns. ``beta`` is the fixed or adaptive controller's coefficient; the
adaptive one moves it after every step so the measured KL tracks ``algorithm.kl.target``.
Metrics ``kl/mean`` (per trained token, before the coefficient) and ``kl/coef``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from nexrl_core.training.algorithms import TEACHER_LOGPROBS
from nexrl_core.training.holder_trainer import HolderTrainer, HolderTrainerConfig, build_estimator, check_teacher
from nexrl_core.training.holders import ServiceHolder
from nexrl_core.training.self_hosted import SelfHostedTrainer, batch_data_metrics
from nexrl_core.types import Trajectory
from nexrl_grpo.config import SelfHostedGrpoConfig
from nexrl_grpo.kl import KLInReward

if TYPE_CHECKING:
    import torch

    from nexrl_core.training.batch import Batch

__all__ = ["HolderGrpoTrainer", "HolderTrainerConfig", "SelfHostedGrpoConfig", "SelfHostedGrpoTrainer"]


def group_metrics(group_ids: Sequence[Any], run_ids: Sequence[Any], rewards: Sequence[float]) -> dict[str, float]:
    """Whether GRPO has anything to learn from: how many groups, which fraction scored the
    same in every run (advantage 0, nothing learnt), and how many had a single run."""
    by_group: dict[Any, dict[Any, float]] = defaultdict(dict)
    for group, run, reward in zip(group_ids, run_ids, rewards):
        by_group[group][run] = reward
    groups = list(by_group.values())
    uniform = sum(1 for runs in groups if len(set(runs.values())) <= 1)
    single = sum(1 for runs in groups if len(runs) == 1)
    return {
        "grpo/groups": float(len(groups)),
        "grpo/uniform_reward_fraction": uniform / len(groups) if groups else 0.0,
        "grpo/single_run_groups": float(single),
    }


class HolderGrpoTrainer(HolderTrainer):
    """GRPO on a service holder (Tinker, Weaver, the local services, the in-process engine)."""

    supports_kl = True

    def __init__(self, config: HolderTrainerConfig | None = None) -> None:
        super().__init__(config)
        self.kl_in_reward = KLInReward(self.config.kl) if self.config.kl.coef > 0 else None

    def shape_rewards(
        self, holder: ServiceHolder, trajectories: Sequence[Trajectory], batch: Batch, token_rewards: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        if self.kl_in_reward is None:
            return token_rewards, {}
        references = holder.reference_logprobs([trajectory.tokens for trajectory in trajectories])
        logprobs = batch.token_values(trajectories, [trajectory.logprobs for trajectory in trajectories])
        ref_logprobs = batch.token_values(trajectories, references)
        return self.kl_in_reward.apply(token_rewards, logprobs, ref_logprobs, batch.tensors["loss_mask"], len(trajectories))

    def extra_metrics(self, trajectories: Sequence[Trajectory], advantages: Sequence[Sequence[float]]) -> dict[str, float]:
        return group_metrics([t.group_id for t in trajectories], [t.run_id for t in trajectories], [t.reward for t in trajectories])

    def state(self) -> dict[str, Any]:
        return self.kl_in_reward.state() if self.kl_in_reward is not None else {}

    def load_state(self, state: dict[str, Any]) -> None:
        if self.kl_in_reward is not None:
            self.kl_in_reward.load_state(state)


class SelfHostedGrpoTrainer(SelfHostedTrainer):
    """GRPO on self-hosted workers: `_prepare_batch` is the algorithm.

    Redundant padding removed; old logprobs recomputed through the transport (optional);
    the outcome reward as token-level scores on each row's last trained token; with
    ``algorithm.kl.coef > 0`` KL in the reward against ``compute_ref_log_prob`` with the
    fixed or adaptive controller; advantages from the registry's estimator; data metrics.
    """

    supports_kl = True
    config: SelfHostedGrpoConfig
    """The base class's ``config``, always GRPO's here: the trainer reads its ``kl``, ``advantage`` and
    ``recompute_old_logprobs``."""

    def __init__(self, config: SelfHostedGrpoConfig | None = None) -> None:
        super().__init__(config if config is not None else SelfHostedGrpoConfig())
        self.kl_in_reward = KLInReward(self.config.kl) if self.config.kl.coef > 0 else None
        self.estimator = build_estimator(self.config)
        check_teacher(self.estimator, self.config)

    def _prepare_batch(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        batch = batch.remove_redundant_left_padding().remove_redundant_right_padding()
        tensors = dict(batch.tensors)
        loss_mask = tensors["loss_mask"]
        valid = tensors["valid_rows"]
        metrics: dict[str, float] = {}
        if self.config.recompute_old_logprobs:
            recomputed = self.transport.compute_log_prob(batch, self.update.micro_batch_rows, self.update.max_tokens_per_microbatch)
            trained = loss_mask > 0
            if trained.any():
                metrics["actor/old_logprob_abs_diff"] = float((recomputed - tensors["old_logprobs"])[trained].abs().mean())
            tensors["old_logprobs"] = recomputed * loss_mask
        inputs = attrs.evolve(batch, tensors=tensors).to_advantage_inputs()
        tensors["token_level_scores"] = inputs.token_rewards
        token_rewards = inputs.token_rewards
        if self.kl_in_reward is not None:
            tensors["ref_logprobs"] = (
                self.transport.compute_ref_log_prob(batch, self.update.micro_batch_rows, self.update.max_tokens_per_microbatch) * loss_mask
            )
            token_rewards, kl_metrics = self.kl_in_reward.apply(
                token_rewards, tensors["old_logprobs"], tensors["ref_logprobs"], loss_mask, int(valid.sum())
            )
            metrics.update(kl_metrics)
        tensors["token_level_rewards"] = token_rewards
        if TEACHER_LOGPROBS in self.estimator.requires:
            tensors[TEACHER_LOGPROBS] = self.teacher_log_prob(batch) * loss_mask
        batch = attrs.evolve(batch, tensors=tensors)
        output = self.estimator(attrs.evolve(batch.to_advantage_inputs(), token_rewards=token_rewards))
        tensors["advantages"] = (output.advantages.detach().to("cpu").float() * loss_mask).contiguous()
        tensors["returns"] = output.returns.detach().to("cpu").float()
        batch = attrs.evolve(batch, tensors=tensors)
        metrics.update({key: float(value) for key, value in output.metrics.items()})
        rows = [row for row, flag in enumerate(valid.tolist()) if flag]
        metrics.update(
            group_metrics(
                [batch.non_tensors["group_ids"][row] for row in rows],
                [batch.non_tensors["run_ids"][row] for row in rows],
                tensors["rewards"][rows].tolist(),
            )
        )
        metrics["grpo/zero_advantage_rows"] = float((tensors["advantages"][valid] == 0).all(dim=1).sum())
        metrics.update(batch_data_metrics(batch))
        return batch, metrics

    def state(self) -> dict[str, Any]:
        return self.kl_in_reward.state() if self.kl_in_reward is not None else {}

    def load_state(self, state: dict[str, Any]) -> None:
        if self.kl_in_reward is not None:
            self.kl_in_reward.load_state(state)
