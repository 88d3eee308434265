"""``remote_api_grpo``: the remote-API trainer with GRPO's group bookkeeping and KL in the reward.

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

from nexrl_core.holders import ServiceHolder
from nexrl_core.types import Trajectory
from nexrl_grpo.kl import build_kl_controller, kl_penalty
from nexrl_remote_api.trainer import RemoteApiTrainer, RemoteApiTrainerConfig

if TYPE_CHECKING:
    import torch

    from nexrl_core.batch import Batch

__all__ = ["RemoteApiGrpoTrainer", "RemoteApiTrainerConfig"]


def _first_trained(trajectory: Trajectory) -> int:
    return next((i for i, flag in enumerate(trajectory.loss_mask) if flag == 1), len(trajectory.tokens))


class RemoteApiGrpoTrainer(RemoteApiTrainer):
    """GRPO on a service holder (Tinker, Weaver, the local services, the in-process engine)."""

    supports_kl = True

    def __init__(self, config: RemoteApiTrainerConfig | None = None) -> None:
        super().__init__(config)
        self.kl_controller = build_kl_controller(self.config.kl) if self.config.kl.coef > 0 else None

    def shape_rewards(
        self, holder: ServiceHolder, trajectories: Sequence[Trajectory], batch: Batch, token_rewards: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        if self.kl_controller is None:
            return token_rewards, {}
        import torch

        references = holder.reference_logprobs([trajectory.tokens for trajectory in trajectories])
        shaped = token_rewards.clone()
        coef = self.kl_controller.value
        total, tokens = 0.0, 0
        for row, (trajectory, reference) in enumerate(zip(trajectories, references)):
            mask = torch.tensor(trajectory.loss_mask, dtype=torch.float64)
            kl = kl_penalty(
                torch.tensor(trajectory.logprobs, dtype=torch.float64),
                torch.tensor(reference, dtype=torch.float64),
                self.config.kl.penalty,
            ) * mask
            offset = batch.prompt_length - _first_trained(trajectory)
            columns = slice(offset, offset + len(trajectory.tokens))
            shaped[row, columns] -= (coef * kl).to(shaped.dtype)
            total += float(kl.sum())
            tokens += int(mask.sum())
        kl_mean = total / tokens if tokens else 0.0
        self.kl_controller.update(kl_mean, n_steps=len(trajectories))
        return shaped, {"kl/mean": kl_mean, "kl/coef": coef}

    def extra_metrics(
        self, trajectories: Sequence[Trajectory], advantages: Sequence[Sequence[float]]
    ) -> dict[str, float]:
        rewards: dict[str, dict[object, float]] = defaultdict(dict)
        for trajectory in trajectories:
            rewards[trajectory.group_id][trajectory.run_id] = trajectory.reward
        groups = list(rewards.values())
        uniform = sum(1 for runs in groups if len(set(runs.values())) <= 1)
        single = sum(1 for runs in groups if len(runs) == 1)
        return {
            "grpo/groups": float(len(groups)),
            "grpo/uniform_reward_fraction": uniform / len(groups) if groups else 0.0,
            "grpo/single_run_groups": float(single),
        }

    def state(self) -> dict[str, Any]:
        return {"kl_coef": self.kl_controller.value} if self.kl_controller is not None else {}

    def load_state(self, state: dict[str, Any]) -> None:
        if self.kl_controller is not None and "kl_coef" in state:
            self.kl_controller.value = float(state["kl_coef"])
