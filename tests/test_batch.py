"""Batch: the padding layout, padding removal, world-size padding and advantage inputs."""

from __future__ import annotations

import pytest
import torch

from nexrl_core.training.batch import Batch
from nexrl_core.types import Trajectory

PAD = 0


def trajectory(tokens: list[int], loss_mask: list[int], reward: float = 0.0, group: str = "g", run: int = 0) -> Trajectory:
    logprobs = [-0.5 * flag for flag in loss_mask]
    return Trajectory(tokens=tokens, loss_mask=loss_mask, logprobs=logprobs, reward=reward, group_id=group, run_id=run, task_id="t")


@pytest.fixture
def batch() -> Batch:
    """Two rows: a 2-token prompt with a 2-token response, and a 1-token prompt with a
    multi-turn response (a tool token with mask 0, then a sampled token equal to PAD)."""
    return Batch.from_trajectories(
        [
            trajectory([1, 2, 3, 4], [0, 0, 1, 1], reward=1.0, run=0),
            trajectory([5, 6, 7, 8, PAD], [0, 1, 1, 0, 1], reward=0.5, run=1),
        ],
        pad_token_id=PAD,
    )


def test_layout_left_pads_prompts_and_right_pads_responses(batch: Batch) -> None:
    tensors = batch.tensors
    assert batch.meta == {"prompt_length": 2, "pad_token_id": PAD}
    assert tensors["input_ids"].tolist() == [[1, 2, 3, 4, PAD, PAD], [PAD, 5, 6, 7, 8, PAD]]
    assert tensors["attention_mask"].tolist() == [[1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1]]
    assert tensors["position_ids"].tolist() == [[0, 1, 2, 3, 0, 0], [0, 0, 1, 2, 3, 4]]
    assert tensors["loss_mask"].tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 0, 1]]
    assert tensors["old_logprobs"].tolist() == [[0, 0, -0.5, -0.5, 0, 0], [0, 0, -0.5, -0.5, 0, -0.5]]
    assert tensors["prompts"].tolist() == [[1, 2], [PAD, 5]]
    assert tensors["responses"].tolist() == [[3, 4, PAD, PAD], [6, 7, 8, PAD]]
    assert tensors["rewards"].tolist() == [1.0, 0.5]
    assert tensors["valid_rows"].tolist() == [True, True]
    assert tensors["loss_mask"].dtype == torch.float32
    assert tensors["input_ids"].dtype == torch.long
    assert batch.non_tensors == {"group_ids": ["g", "g"], "run_ids": [0, 1], "task_ids": ["t", "t"], "is_val": [False, False]}
    assert len(batch) == batch.batch_size == 2


def test_token_values_sit_in_the_columns_of_their_tokens(batch: Batch) -> None:
    """A holder's per-token values (reference or teacher logprobs) land where the row's
    tokens landed, so column j of every table is about the same token."""
    trajectories = [
        trajectory([1, 2, 3, 4], [0, 0, 1, 1], run=0),
        trajectory([5, 6, 7, 8, PAD], [0, 1, 1, 0, 1], run=1),
    ]
    table = batch.token_values(trajectories, [[0.0, -0.1, -0.2, -0.3], [0.0, -1.1, -1.2, -1.3, -1.4]])
    assert table.dtype == torch.float64
    assert table.tolist() == [[0.0, -0.1, -0.2, -0.3, 0.0, 0.0], [0.0, 0.0, -1.1, -1.2, -1.3, -1.4]]
    with pytest.raises(ValueError, match="row 1: 4 values for 5 tokens"):
        batch.token_values(trajectories, [[0.0] * 4, [0.0] * 4])


def test_a_trajectory_without_trained_tokens_is_all_prompt() -> None:
    batch = Batch.from_trajectories([trajectory([1, 2, 3], [0, 0, 0]), trajectory([4, 5], [0, 1])], pad_token_id=PAD)
    assert batch.meta["prompt_length"] == 3
    assert batch.tensors["input_ids"].tolist() == [[1, 2, 3, PAD], [PAD, PAD, 4, 5]]
    assert batch.tensors["responses"].tolist() == [[PAD], [5]]


def test_from_trajectories_rejects_an_empty_list() -> None:
    with pytest.raises(ValueError, match="at least one trajectory"):
        Batch.from_trajectories([], pad_token_id=PAD)


def test_rows_must_agree_in_count() -> None:
    with pytest.raises(ValueError, match="same number of rows"):
        Batch(tensors={"attention_mask": torch.ones(2, 3)}, non_tensors={"group_ids": ["a"]})


def test_redundant_padding_is_removed_from_every_column_tensor(batch: Batch) -> None:
    second = batch.select([1])
    trimmed = second.remove_redundant_left_padding()
    assert trimmed.meta["prompt_length"] == 1
    assert trimmed.tensors["input_ids"].tolist() == [[5, 6, 7, 8, PAD]]
    assert trimmed.tensors["prompts"].tolist() == [[5]]
    assert trimmed.tensors["position_ids"].tolist() == [[0, 1, 2, 3, 4]]
    # The last token equals the pad id but is attended: it is a real sampled token and stays.
    assert trimmed.remove_redundant_right_padding().tensors["input_ids"].tolist() == [[5, 6, 7, 8, PAD]]

    first = batch.select([0]).remove_redundant_right_padding()
    assert first.tensors["input_ids"].tolist() == [[1, 2, 3, 4]]
    assert first.tensors["responses"].tolist() == [[3, 4]]
    assert first.tensors["loss_mask"].tolist() == [[0, 0, 1, 1]]
    assert first.meta["prompt_length"] == 2
    assert first.non_tensors["run_ids"] == [0]


def test_removing_padding_from_a_tight_batch_changes_nothing(batch: Batch) -> None:
    trimmed = batch.remove_redundant_left_padding().remove_redundant_right_padding()
    for name, tensor in batch.tensors.items():
        assert torch.equal(trimmed.tensors[name], tensor), name


def test_pad_to_world_size_appends_placeholder_rows_not_copies(batch: Batch) -> None:
    padded = batch.pad_to_world_size(4)
    tensors = padded.tensors
    assert padded.batch_size == 4
    assert tensors["valid_rows"].tolist() == [True, True, False, False]
    assert tensors["input_ids"][2:].tolist() == [[PAD] * 6] * 2
    assert tensors["attention_mask"][2:].tolist() == [[0, 1, 0, 0, 0, 0]] * 2
    assert tensors["loss_mask"][2:].abs().sum() == 0
    assert tensors["old_logprobs"][2:].abs().sum() == 0
    assert tensors["rewards"].tolist() == [1.0, 0.5, 0.0, 0.0]
    assert tensors["responses"][2:].tolist() == [[PAD] * 4] * 2
    assert padded.non_tensors["group_ids"] == ["g", "g", "__padding__2", "__padding__3"]
    assert padded.non_tensors["is_val"] == [False] * 4
    assert (tensors["attention_mask"].sum(dim=1) > 0).all()
    for name, tensor in batch.tensors.items():
        assert torch.equal(tensors[name][:2], tensor), name


def test_pad_to_world_size_without_a_prompt_attends_column_zero() -> None:
    batch = Batch.from_trajectories([trajectory([3, 4], [1, 1])], pad_token_id=PAD)
    assert batch.pad_to_world_size(2).tensors["attention_mask"].tolist() == [[1, 1], [1, 0]]


def test_pad_to_world_size_when_already_divisible_and_on_bad_input(batch: Batch) -> None:
    assert batch.pad_to_world_size(2) is batch
    assert batch.pad_to_world_size(1) is batch
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        batch.pad_to_world_size(0)


def test_advantage_inputs_put_each_reward_on_the_last_trained_token(batch: Batch) -> None:
    inputs = batch.pad_to_world_size(3).to_advantage_inputs()
    assert inputs.token_rewards.tolist() == [
        [0, 0, 0, 1.0, 0, 0],
        [0, 0, 0, 0, 0, 0.5],
        [0, 0, 0, 0, 0, 0],
    ]
    assert inputs.valid_rows.tolist() == [True, True, False]
    assert inputs.group_ids == ["g", "g", "__padding__2"]
    assert inputs.run_ids == [0, 1, "__padding__2"]
    assert inputs.old_logprobs is not None and inputs.old_logprobs.shape == (3, 6)
    assert inputs.ref_logprobs is None


def test_advantage_inputs_drop_the_reward_of_a_row_with_nothing_to_train() -> None:
    batch = Batch.from_trajectories([trajectory([1, 2], [0, 0], reward=3.0)], pad_token_id=PAD)
    assert batch.to_advantage_inputs().token_rewards.abs().sum() == 0
