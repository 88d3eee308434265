"""Entry-point module: registers this plugin's advantage estimators, policy losses and trainers.

The core loads it through the ``nexrl.plugins`` entry point whenever it builds its
registries, including for ``nexrl plugins`` on a machine without a GPU, so it imports
only the config classes and names every factory as a ``"module:attr"`` string that is
resolved when a run picks that name.
"""

from __future__ import annotations

from nexrl_core.plugins.hookspecs import hookimpl
from nexrl_core.plugins.specs import AdvantageEstimatorSpec, PolicyLossSpec, TrainerSpec
from nexrl_core.training.holder_trainer import HolderTrainerConfig
from nexrl_core.training.self_hosted import TRANSPORT_TRAINER
from nexrl_grpo.config import (
    CispoLossConfig,
    CrossEntropyLossConfig,
    DrGrpoConfig,
    DroLossConfig,
    GrpoConfig,
    GspoLossConfig,
    ImportanceSamplingLossConfig,
    OnPolicyDistillationConfig,
    PPOLossConfig,
    ReinforcePlusPlusConfig,
    RlooConfig,
    SelfHostedGrpoConfig,
)

_GROUP_RELATIVE = frozenset({"group_relative"})
_TRANSPORT = frozenset({TRANSPORT_TRAINER})


@hookimpl
def nexrl_advantage_estimators() -> list[AdvantageEstimatorSpec]:
    """GRPO-family estimators; the group-relative ones say so in their capabilities."""
    return [
        AdvantageEstimatorSpec(
            name="grpo",
            factory="nexrl_grpo.advantages:GrpoEstimator",
            config_class=GrpoConfig,
            description="GRPO: score minus the group mean of run scores, divided by their std",
            capabilities=_GROUP_RELATIVE,
        ),
        AdvantageEstimatorSpec(
            name="dr_grpo",
            factory="nexrl_grpo.advantages:DrGrpoEstimator",
            config_class=DrGrpoConfig,
            description="Dr. GRPO: score minus the group mean of run scores, no std division",
            capabilities=_GROUP_RELATIVE,
        ),
        AdvantageEstimatorSpec(
            name="rloo",
            factory="nexrl_grpo.advantages:RlooEstimator",
            config_class=RlooConfig,
            description="RLOO: score minus the mean of the other runs in the group",
            capabilities=_GROUP_RELATIVE,
        ),
        AdvantageEstimatorSpec(
            name="reinforce_plus_plus",
            factory="nexrl_grpo.advantages:ReinforcePlusPlusEstimator",
            config_class=ReinforcePlusPlusConfig,
            description="REINFORCE++: discounted per-token returns whitened over the batch",
        ),
        AdvantageEstimatorSpec(
            name="on_policy_distillation",
            factory="nexrl_grpo.distillation:OnPolicyDistillationEstimator",
            config_class=OnPolicyDistillationConfig,
            description="On-policy distillation: -coef * (student - teacher logprob) per sampled token, needs teacher.model",
        ),
    ]


@hookimpl
def nexrl_policy_losses() -> list[PolicyLossSpec]:
    """The policy losses, the single source of loss math for every backend."""
    return [
        PolicyLossSpec(
            name="ppo",
            factory="nexrl_grpo.losses:PPOLoss",
            config_class=PPOLossConfig,
            description="PPO clipped surrogate, optional dual clip and entropy bonus",
        ),
        PolicyLossSpec(
            name="importance_sampling",
            factory="nexrl_grpo.losses:ImportanceSamplingLoss",
            config_class=ImportanceSamplingLossConfig,
            description="Unclipped importance-weighted policy gradient: -ratio * A",
        ),
        PolicyLossSpec(
            name="cross_entropy",
            factory="nexrl_grpo.losses:CrossEntropyLoss",
            config_class=CrossEntropyLossConfig,
            description="Weighted negative log-likelihood (supervised fine-tuning)",
        ),
        PolicyLossSpec(
            name="cispo",
            factory="nexrl_grpo.losses:CispoLoss",
            config_class=CispoLossConfig,
            description="CISPO: clipped, detached importance weight times A times -logp",
        ),
        PolicyLossSpec(
            name="gspo",
            factory="nexrl_grpo.losses:GspoLoss",
            config_class=GspoLossConfig,
            description="GSPO: PPO clipping on the length-normalised sequence ratio",
        ),
        PolicyLossSpec(
            name="dro",
            factory="nexrl_grpo.losses:DroLoss",
            config_class=DroLossConfig,
            description="DRO: -(A * logp) plus beta/2 * (logp - logq)^2, a quadratic pull to the sampler",
        ),
    ]


@hookimpl
def nexrl_trainers() -> list[TrainerSpec]:
    """The GRPO trainers; both build their config from the recipe's ``algorithm``. The
    self-hosted one has capability ``transport``: it trains through a transport's workers,
    not a service holder."""
    return [
        TrainerSpec(
            name="remote_api_grpo",
            factory="nexrl_grpo.trainers:HolderGrpoTrainer",
            config_class=HolderTrainerConfig,
            description="GRPO on a remote training API (Tinker, Weaver, local services): datums + AdamW step",
        ),
        TrainerSpec(
            name="self_hosted_grpo",
            factory="nexrl_grpo.trainers:SelfHostedGrpoTrainer",
            config_class=SelfHostedGrpoConfig,
            description="GRPO on self-hosted FSDP workers: a padded Batch, advantages here, the update on the workers",
            capabilities=_TRANSPORT,
        ),
    ]
