"""Trajectory, RemoteDatum and SampleResult: invariants and the one-token shift."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from nexrl_core.types import RemoteDatum, SampleResult, Trajectory


def make_trajectory(**changes: object) -> Trajectory:
    fields: dict[str, object] = {
        "tokens": [10, 11, 12, 13, 14],
        "loss_mask": [0, 0, 1, 1, 0],
        "logprobs": [0.0, 0.0, -0.5, -0.25, 0.0],
        "reward": 1.0,
        "group_id": "g0",
        "run_id": 0,
        "task_id": "t0",
    }
    fields.update(changes)
    return Trajectory(**fields)  # type: ignore[arg-type]


def test_trajectory_defaults() -> None:
    trajectory = make_trajectory()
    assert trajectory.is_val is False
    assert trajectory.extra == {}


def test_trajectory_rejects_unequal_lengths_naming_each_length() -> None:
    with pytest.raises(ValueError, match="tokens=5, loss_mask=4, logprobs=5"):
        make_trajectory(loss_mask=[0, 0, 1, 1])


def test_trajectory_rejects_a_non_binary_loss_mask() -> None:
    with pytest.raises(ValueError, match="got 2 at index 3"):
        make_trajectory(loss_mask=[0, 0, 1, 2, 0])


@pytest.mark.parametrize("reward", [math.nan, math.inf, True, "1.0"])
def test_trajectory_rejects_a_reward_that_is_not_a_finite_number(reward: object) -> None:
    with pytest.raises(ValueError, match="reward must be a finite number"):
        make_trajectory(reward=reward)


def test_trajectory_rejects_empty_tokens() -> None:
    with pytest.raises(ValueError, match="tokens must not be empty"):
        make_trajectory(tokens=[], loss_mask=[], logprobs=[])


def test_remote_datum_shifts_by_one_with_a_scalar_advantage() -> None:
    datum = RemoteDatum.from_trajectory(make_trajectory(), advantage=2.0)
    assert datum.input_tokens == [10, 11, 12, 13]
    assert datum.target_tokens == [11, 12, 13, 14]
    assert datum.sampling_logprobs == [0.0, -0.5, -0.25, 0.0]
    assert datum.loss_mask == [0.0, 1.0, 1.0, 0.0]
    assert datum.advantages == [0.0, 2.0, 2.0, 0.0]
    assert not datum.all_advantages_zero


def test_remote_datum_shifts_per_token_advantages() -> None:
    datum = RemoteDatum.from_trajectory(make_trajectory(), advantage=[9.0, 0.0, 1.5, -0.5, 0.0])
    assert datum.advantages == [0.0, 1.5, -0.5, 0.0]


def test_remote_datum_rejects_misaligned_per_token_advantages() -> None:
    with pytest.raises(ValueError, match="align with the trajectory's 5 tokens, got 4"):
        RemoteDatum.from_trajectory(make_trajectory(), advantage=[0.0, 1.0, 1.0, 0.0])


def test_remote_datum_needs_two_tokens() -> None:
    single = make_trajectory(tokens=[7], loss_mask=[1], logprobs=[-1.0])
    with pytest.raises(ValueError, match="at least 2 tokens"):
        RemoteDatum.from_trajectory(single, advantage=1.0)


def test_remote_datum_with_zero_advantage_reports_it() -> None:
    assert RemoteDatum.from_trajectory(make_trajectory(), advantage=0.0).all_advantages_zero


def test_remote_datum_rejects_unequal_lengths() -> None:
    with pytest.raises(ValueError, match="equal lengths"):
        RemoteDatum(input_tokens=[1], target_tokens=[2], sampling_logprobs=[], advantages=[0.0], loss_mask=[1.0])


TOOL_CALL = {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}


def make_sample(**changes: object) -> SampleResult:
    fields: dict[str, object] = {
        "prompt_tokens": [1, 2],
        "response_tokens": [3, 4],
        "response_logprobs": [-0.1, -0.2],
        "response_text": "hi",
        "finish_reason": "stop",
    }
    fields.update(changes)
    return SampleResult(**fields)  # type: ignore[arg-type]


def test_sample_result_accepts_openai_tool_calls() -> None:
    sample = make_sample(tool_calls=[TOOL_CALL], finish_reason="length")
    assert sample.tool_calls[0]["function"]["name"] == "add"


@pytest.mark.parametrize(
    "bad_call",
    [
        {**TOOL_CALL, "type": "tool"},
        {**TOOL_CALL, "function": {"name": "add", "arguments": {"a": 1}}},
        {"type": "function", "function": TOOL_CALL["function"]},
        "add(1)",
    ],
)
def test_sample_result_rejects_malformed_tool_calls(bad_call: object) -> None:
    with pytest.raises(ValueError, match=r"tool_calls\[0\] must look like"):
        make_sample(tool_calls=[bad_call])


def test_sample_result_rejects_an_unknown_finish_reason() -> None:
    with pytest.raises(ValueError, match="finish_reason must be one of"):
        make_sample(finish_reason="tool_calls")


def test_sample_result_rejects_misaligned_logprobs() -> None:
    with pytest.raises(ValueError, match="response_tokens=2, response_logprobs=1"):
        make_sample(response_logprobs=[-0.1])


def test_importing_types_config_and_batch_leaves_torch_and_numpy_out() -> None:
    code = (
        "import nexrl_core.types, nexrl_core.config, nexrl_core.training.batch, nexrl_core.commands.config; import sys; "
        "heavy = [m for m in ('torch', 'numpy', 'zmq', 'fastapi') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    repo_root = Path(__file__).resolve().parents[1]
    completed = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
