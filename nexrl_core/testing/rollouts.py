"""Real rollouts for contract tests: a group of samples from a `ChatModel`, as trajectories."""

from __future__ import annotations

from collections.abc import Sequence

from nexrl_core.chat.model import ChatModel, SamplingOptions
from nexrl_core.types import SampleResult, Trajectory

CONTRACT_MESSAGES = [{"role": "user", "content": "12+7="}]
GROUP_REWARDS = (1.0, 0.0, 0.0, 1.0)
"""Rewards of the four runs of `sampled_group`: unequal, so every estimator sees signal."""


def trajectory_of(sample: SampleResult, reward: float, group_id: str, run_id: int) -> Trajectory:
    """One single-turn run: the prompt is context (mask 0), the response is trained."""
    prompt, response = list(sample.prompt_tokens), list(sample.response_tokens)
    return Trajectory(
        tokens=prompt + response,
        loss_mask=[0] * len(prompt) + [1] * len(response),
        logprobs=[0.0] * len(prompt) + list(sample.response_logprobs),
        reward=reward,
        group_id=group_id,
        run_id=run_id,
        task_id=group_id,
    )


def sampled_group(model: ChatModel, group_id: str = "contract", rewards: Sequence[float] = GROUP_REWARDS) -> list[Trajectory]:
    """One group of runs sampled from ``model`` (seeded), with ``rewards``."""
    return [
        trajectory_of(model.sample_from_messages(CONTRACT_MESSAGES, SamplingOptions(max_tokens=6, seed=run)), reward, group_id, run)
        for run, reward in enumerate(rewards)
    ]


def probe_sample(model: ChatModel) -> SampleResult:
    """A fixed-seed sample whose logprobs show which weights sampling uses."""
    return model.sample_from_messages(CONTRACT_MESSAGES, SamplingOptions(max_tokens=6, seed=99))
