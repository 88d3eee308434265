"""On-policy distillation: the teacher's reverse KL on the student's own samples is the advantage.

The student samples; the recipe's teacher scores every sampled token; per trained token
``x_t = -kl_coef * (log p_student(y_t) - log p_teacher(y_t))``, a one-sample estimate
of the negative reverse KL ``-KL(student || teacher)`` that the policy gradient then
maximises (the Tinker cookbook's ``distillation/train_on_policy.py``, Agarwal et al.
2024). The student's log-probs are the sampler's (``old_logprobs``), as the cookbook
takes them, so the advantage describes the tokens as they were drawn.

With ``kl_discount`` above 0 a token's advantage is the discounted sum of its own and
every later trained token's term, so an early token is also charged for the divergence
it leads into. A step is a trained token, as in ``reinforce_plus_plus``: within one turn
this is the cookbook's per-position discount; tool output between turns is not a step.

Every row is computed on its own (the KL part reads nothing of other rows), so the
advantages do not depend on how a step's rows are split or padded; an added
``task_advantage`` is the registered group-relative estimator's, with its own group
statistics.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from nexrl_core.training.algorithms import TEACHER_LOGPROBS, AdvantageInputs, AdvantageOutput
from nexrl_grpo.advantages import (
    DrGrpoEstimator,
    GrpoEstimator,
    RlooEstimator,
    _check,
    _output_dtype,
    _row_list,
    _sorted_sum,
    _token_metrics,
    _trained,
    discounted_returns,
)
from nexrl_grpo.config import DrGrpoConfig, GrpoConfig, OnPolicyDistillationConfig, RlooConfig, TaskAdvantage

__all__ = ["OnPolicyDistillationEstimator"]

_LOGPROBS = frozenset({"old_logprobs", TEACHER_LOGPROBS})
_TASK_ESTIMATORS: dict[TaskAdvantage, Any] = {
    TaskAdvantage.GRPO: lambda: GrpoEstimator(GrpoConfig()),
    TaskAdvantage.DR_GRPO: lambda: DrGrpoEstimator(DrGrpoConfig()),
    TaskAdvantage.RLOO: lambda: RlooEstimator(RlooConfig()),
}
"""The group-relative estimator each `TaskAdvantage` adds, with its default options."""


class OnPolicyDistillationEstimator:
    """A = discounted sum of ``-kl_coef * (student - teacher)`` over the row's later
    trained tokens, plus the task reward's group-relative advantage when one is chosen."""

    name: ClassVar[str] = "on_policy_distillation"
    group_relative: ClassVar[bool] = False

    def __init__(self, config: OnPolicyDistillationConfig) -> None:
        self.config = config
        build_task = _TASK_ESTIMATORS.get(config.task_advantage)
        self.task_estimator = build_task() if build_task is not None else None
        self.requires: frozenset[str] = _LOGPROBS | (self.task_estimator.requires if self.task_estimator else frozenset())

    def _logprob_table(self, inputs: AdvantageInputs, field: str, counted: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
        """``field`` in float64, checked: [B, T] and finite on every trained token of a counted row."""
        values: torch.Tensor = getattr(inputs, field)
        if values.shape != inputs.loss_mask.shape:
            raise ValueError(
                f"advantage estimator {self.name!r}: {field} must have loss_mask's shape {tuple(inputs.loss_mask.shape)}, "
                f"got {tuple(values.shape)}"
            )
        values = values.detach().to(trained.device, torch.float64)
        bad = torch.nonzero((trained & ~torch.isfinite(values)).any(dim=-1).cpu() & counted).flatten()
        if bad.numel():
            raise ValueError(f"advantage estimator {self.name!r}: {field} is NaN or infinite on trained tokens of rows {_row_list(bad)}")
        return torch.where(trained, values, torch.zeros_like(values))

    def __call__(self, inputs: AdvantageInputs) -> AdvantageOutput:
        counted = _check(self.name, self.requires, inputs)
        trained = _trained(inputs, counted)
        student = self._logprob_table(inputs, "old_logprobs", counted, trained)
        teacher = self._logprob_table(inputs, TEACHER_LOGPROBS, counted, trained)
        reverse_kl = student - teacher
        advantages = discounted_returns(-self.config.kl_coef * reverse_kl, trained, self.config.kl_discount)

        kl_values = reverse_kl[trained].cpu()
        metrics = {"teacher/reverse_kl": float(_sorted_sum(kl_values) / kl_values.numel()) if kl_values.numel() else 0.0}
        if self.task_estimator is not None:
            task = self.task_estimator(inputs)
            advantages = advantages + torch.where(trained, task.advantages.detach().to(advantages), 0.0)
            metrics.update({f"task/{key}": float(value) for key, value in task.metrics.items()})
        advantages = advantages.to(_output_dtype(inputs))
        metrics.update(_token_metrics(advantages, trained))
        return AdvantageOutput(advantages=advantages, returns=advantages, metrics=metrics)
