"""On a CUDA GPU: ``nexrl train`` with the embedded service on ``backend.options.device=cuda``
(the Tinker quickstart in fp32, the Weaver quickstart in bf16 with LoRA rank 8), driven by
the real tinker and nex-weaver clients; each run must raise the held-out reward.
Skipped where torch sees no GPU (``pytest -m gpu`` runs only these)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nexrl_testing.served_runs import held_out_rewards, train

pytestmark = pytest.mark.gpu

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


@pytest.mark.parametrize(
    ("recipe", "precision", "steps", "rise"),
    [
        (None, [], 6, 0.15),
        ("quickstart_weaver.yaml", ["model.dtype=bf16", "model.lora.rank=8"], 12, 0.1),
    ],
    ids=["tinker-fp32", "weaver-bf16-lora8"],
)
def test_the_embedded_service_on_cuda_raises_held_out_reward(
    tmp_path: Path, recipe: str | None, precision: list[str], steps: int, rise: float
) -> None:
    if recipe is not None:
        pytest.importorskip("nexrl_weaver")
    rows = train(
        tmp_path / "run",
        "backend.options.device=cuda",
        *precision,
        f"schedule.steps={steps}",
        f"schedule.validate_every={steps}",
        f"schedule.checkpoint_every={steps}",
        "task.val_size=128",
        recipe=RECIPES / recipe if recipe else None,
        env={"TINKER_API_KEY": None, "WEAVER_API_KEY": None, "WEAVER_BASE_URL": None},  # the embedded service's own key
    )
    assert rows[0]["backend/device"] == "cuda", "the embedded service runs its engines on the GPU"
    assert rows[0]["backend/dtype"] == ("bfloat16" if precision else "float32")
    rewards = held_out_rewards(rows)
    assert rewards[steps] >= rewards[0] + rise, f"held-out reward did not rise: {rewards}"
