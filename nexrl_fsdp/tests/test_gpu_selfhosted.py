"""On CUDA GPUs: the self-hosted backend trains on NCCL worker ranks (one GPU each) with
its sampler process on a GPU, and raises the held-out reward; on one rank and on every GPU
of the machine. Skipped where torch sees no GPU (``make test-gpu``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nexrl_testing.served_runs import held_out_rewards, train

pytestmark = pytest.mark.gpu

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "quickstart_fsdp.yaml"
STEPS = 10


def _ranks() -> list[int]:
    every = torch.cuda.device_count() if torch.cuda.is_available() else 1
    return [1] if every <= 1 else [1, every]


@pytest.mark.parametrize("ranks", _ranks(), ids=lambda ranks: f"{ranks}-ranks")
def test_self_hosted_on_nccl_ranks_raises_held_out_reward(tmp_path: Path, ranks: int) -> None:
    rows = train(
        tmp_path / "run",
        f"backend.options.world_size={ranks}",
        "backend.options.sampler.device=cuda",
        f"schedule.steps={STEPS}",
        f"schedule.validate_every={STEPS}",
        "schedule.checkpoint_every=5",
        "task.val_size=128",
        recipe=RECIPE,
        timeout_s=400,
    )
    assert (rows[0]["backend/device"], rows[0]["backend/world_size"]) == ("cuda", str(ranks)), "the ranks train on GPUs"
    rewards = held_out_rewards(rows)
    assert rewards[STEPS] >= rewards[0] + 0.2, f"held-out reward did not rise: {rewards}"
