"""``on_policy_distillation``: the advantage is the negative reverse KL to the teacher.

Each test compares the estimator with a formula written out here token by token, on
log-probs chosen by hand so that a flipped sign, an ignored discount or a teacher value
read one position off gives other numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from nexrl_core.config.errors import ConfigError
from nexrl_core.config.schema import ComponentChoice, TeacherConfig
from nexrl_core.plugins.registry import get_advantage_estimator
from nexrl_core.training.algorithms import AdvantageInputs
from nexrl_core.training.holder_trainer import HolderTrainer, HolderTrainerConfig
from nexrl_grpo.advantages import DrGrpoEstimator
from nexrl_grpo.config import DrGrpoConfig, OnPolicyDistillationConfig, TaskAdvantage

STUDENT = [[0.0, 0.0, -0.5, -1.25, -2.0, -0.1], [0.0, -0.3, -0.7, -0.2, 0.0, 0.0]]
TEACHER = [[0.0, 0.0, -1.5, -1.0, -0.25, -3.0], [0.0, -0.9, -0.1, -2.2, 0.0, 0.0]]
MASK = [[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]]
"""Two rows: a prompt of 2 then 4 trained tokens, and a prompt of 1 then 3 trained tokens
and padding; every trained token's log ratio differs from its neighbours'."""


def _inputs(
    student: Sequence[Sequence[float]] = STUDENT,
    teacher: Sequence[Sequence[float]] = TEACHER,
    mask: Sequence[Sequence[float]] = MASK,
    rewards: Sequence[float] = (0.0, 0.0),
    groups: Sequence[str] = ("a", "a"),
) -> AdvantageInputs:
    loss_mask = torch.tensor(mask, dtype=torch.float32)
    token_rewards = torch.zeros_like(loss_mask)
    for row, reward in enumerate(rewards):
        last = int(torch.nonzero(loss_mask[row]).max())
        token_rewards[row, last] = reward
    return AdvantageInputs(
        token_rewards=token_rewards,
        loss_mask=loss_mask,
        valid_rows=torch.ones(len(mask), dtype=torch.bool),
        group_ids=list(groups),
        run_ids=list(range(len(mask))),
        old_logprobs=torch.tensor(student, dtype=torch.float32),
        teacher_logprobs=torch.tensor(teacher, dtype=torch.float32),
    )


def _estimate(config: OnPolicyDistillationConfig, inputs: AdvantageInputs) -> torch.Tensor:
    return get_advantage_estimator("on_policy_distillation", config)(inputs).advantages


def _expected(coef: float, discount: float, mask: Sequence[Sequence[float]] = MASK) -> list[list[float]]:
    """Per trained token t: sum over trained tokens k >= t of discount^(steps from t to k)
    * -coef * (student[k] - teacher[k]), a step being a trained token; 0 elsewhere."""
    table = []
    for student, teacher, flags in zip(STUDENT, TEACHER, mask):
        trained = [column for column, flag in enumerate(flags) if flag]
        row = [0.0] * len(flags)
        for position, t in enumerate(trained):
            row[t] = sum(discount**steps * -coef * (student[k] - teacher[k]) for steps, k in enumerate(trained[position:]))
        table.append(row)
    return table


def test_the_advantage_is_minus_coef_times_the_log_ratio_of_each_sampled_token() -> None:
    advantages = _estimate(OnPolicyDistillationConfig(kl_coef=0.5), _inputs())
    torch.testing.assert_close(advantages, torch.tensor(_expected(0.5, 0.0)))
    assert advantages[0, 3] > 0, "a token the teacher likes more than the student does is pushed up"
    assert advantages[0, 2] < 0, "a token the student likes more than the teacher does is pushed down"


def test_kl_discount_adds_the_discounted_later_tokens() -> None:
    advantages = _estimate(OnPolicyDistillationConfig(kl_discount=0.5), _inputs())
    torch.testing.assert_close(advantages, torch.tensor(_expected(1.0, 0.5)))
    torch.testing.assert_close(advantages[1, 1], torch.tensor(-(0.6) + 0.5 * 0.6 + 0.25 * -2.0))


def test_within_a_turn_the_discount_is_the_cookbooks_per_position_sum() -> None:
    metrics = pytest.importorskip("tinker_cookbook.rl.metrics")
    advantages = _estimate(OnPolicyDistillationConfig(kl_coef=2.0, kl_discount=0.9), _inputs())
    for row, (student, teacher, flags) in enumerate(zip(STUDENT, TEACHER, MASK)):
        kl = -2.0 * (torch.tensor(student, dtype=torch.float64) - torch.tensor(teacher, dtype=torch.float64))
        trained = torch.tensor(flags, dtype=torch.bool)
        cookbook = metrics.discounted_future_sum_vectorized(torch.where(trained, kl, 0.0), 0.9)
        torch.testing.assert_close(advantages[row][trained].double(), cookbook[trained])


def test_tool_output_between_turns_is_no_step_of_the_discount() -> None:
    mask = [[0, 0, 1, 0, 1, 1], [0, 1, 1, 1, 0, 0]]
    advantages = _estimate(OnPolicyDistillationConfig(kl_discount=0.5), _inputs(mask=mask))
    torch.testing.assert_close(advantages, torch.tensor(_expected(1.0, 0.5, mask)))
    assert advantages[0, 3] == 0


def test_the_task_advantage_is_added_to_the_distillation_term() -> None:
    inputs = _inputs(rewards=(1.0, 0.0))
    combined = _estimate(OnPolicyDistillationConfig(task_advantage=TaskAdvantage.DR_GRPO), inputs)
    task = DrGrpoEstimator(DrGrpoConfig())(inputs).advantages
    torch.testing.assert_close(combined, torch.tensor(_expected(1.0, 0.0)) + task)
    assert task[0, 2] == 0.5 and task[1, 1] == -0.5


def test_advantages_are_the_same_however_the_step_is_split_or_padded() -> None:
    config = OnPolicyDistillationConfig(kl_coef=0.7, kl_discount=0.8)
    whole = _estimate(config, _inputs())
    for row in range(2):
        alone = _inputs(student=[STUDENT[row]], teacher=[TEACHER[row]], mask=[MASK[row]], rewards=[0.0], groups=["a"])
        torch.testing.assert_close(_estimate(config, alone)[0], whole[row])
    wider = _inputs(
        student=[[0.0, *row, 0.0] for row in STUDENT],
        teacher=[[-9.0, *row, -9.0] for row in TEACHER],
        mask=[[0, *row, 0] for row in MASK],
    )
    torch.testing.assert_close(_estimate(config, wider)[:, 1:-1], whole)


def test_non_finite_teacher_logprobs_on_a_trained_token_are_refused() -> None:
    teacher = [list(TEACHER[0]), list(TEACHER[1])]
    teacher[1][2] = float("-inf")
    with pytest.raises(ValueError, match=r"teacher_logprobs is NaN or infinite on trained tokens of rows \[1\]"):
        _estimate(OnPolicyDistillationConfig(), _inputs(teacher=teacher))


def test_bad_options_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="kl_coef must be a finite number > 0"):
        OnPolicyDistillationConfig(kl_coef=0.0)
    with pytest.raises(ValueError, match=r"kl_discount must be in \[0, 1\]"):
        OnPolicyDistillationConfig(kl_discount=1.5)
    with pytest.raises(ValueError, match="choose one of 'none', 'grpo', 'dr_grpo', 'rloo'"):
        OnPolicyDistillationConfig(task_advantage="ppo")


def _trainer_config(estimator: str, teacher: str | None) -> HolderTrainerConfig:
    return HolderTrainerConfig(advantage=ComponentChoice(name=estimator), teacher=TeacherConfig(model=teacher))


def test_the_estimator_without_a_teacher_is_refused_before_step_1() -> None:
    with pytest.raises(ConfigError, match="algorithm.advantage.name: 'on_policy_distillation' reads a teacher"):
        HolderTrainer(_trainer_config("on_policy_distillation", None))


def test_a_teacher_no_estimator_reads_is_refused_before_step_1() -> None:
    with pytest.raises(ConfigError, match="teacher.model: advantage estimator 'grpo' reads no teacher log-probs"):
        HolderTrainer(_trainer_config("grpo", "nexrl-tiny"))
