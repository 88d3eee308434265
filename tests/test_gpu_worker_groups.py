"""On a CUDA GPU: the embedded Tinker and Weaver services train each model on its own
worker group (``backend.options.workers=1``: an NCCL rank on the GPU) with their samplers
on the GPU, driven by the real tinker and nex-weaver clients; the held-out reward rises.
Skipped where torch sees no GPU (``make test-gpu``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nexrl_testing.served_runs import held_out_rewards, train

pytestmark = pytest.mark.gpu

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
STEPS = 8


@pytest.mark.parametrize("recipe", [None, "quickstart_weaver.yaml"], ids=["tinker", "weaver"])
def test_a_service_worker_group_on_cuda_raises_held_out_reward(tmp_path: Path, recipe: str | None) -> None:
    rows = train(
        tmp_path / "run",
        "backend.options.workers=1",
        "backend.options.device=cuda",
        f"schedule.steps={STEPS}",
        f"schedule.validate_every={STEPS}",
        f"schedule.checkpoint_every={STEPS}",
        "task.val_size=128",
        recipe=RECIPES / recipe if recipe else None,
        timeout_s=400,
        env={"TINKER_API_KEY": None, "WEAVER_API_KEY": None, "WEAVER_BASE_URL": None},
    )
    rewards = held_out_rewards(rows)
    assert rewards[STEPS] >= rewards[0] + 0.1, f"held-out reward did not rise: {rewards}"
