"""``remote_api_grpo``: the core's `RemoteApiTrainer` with GRPO's group bookkeeping.

Advantages come from the recipe's estimator (``grpo`` by default) through the registry;
this flavour adds the numbers that tell whether GRPO has anything to learn from: how
many groups there were and which fraction had all runs score the same (those get
advantage 0 and are skipped, so a run where every group is uniform stops learning).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from nexrl_core.types import Trajectory
from nexrl_remote_api.trainer import RemoteApiTrainer, RemoteApiTrainerConfig

__all__ = ["RemoteApiGrpoTrainer", "RemoteApiTrainerConfig"]


class RemoteApiGrpoTrainer(RemoteApiTrainer):
    """GRPO on a remote training API (Tinker, Weaver, the local services)."""

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
