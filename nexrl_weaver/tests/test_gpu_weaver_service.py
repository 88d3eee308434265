"""On a CUDA GPU: ``nexrl serve weaver --device cuda`` (fp32, and bf16 for a LoRA rank-8
run), driven by the real nex-weaver SDK through ``nexrl train`` against its URL; the run
must raise the held-out reward, and the service must say it runs on the GPU. Skipped where
torch sees no GPU (``pytest -m gpu`` runs only these)."""

from __future__ import annotations

from pathlib import Path

import pytest
from nexrl_weaver.testing import TEST_API_KEY

from nexrl_testing.served_runs import held_out_rewards, serving, train

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    ("dtype", "lora_rank", "steps", "rise"), [("fp32", 0, 6, 0.15), ("bf16", 8, 12, 0.1)], ids=["fp32", "bf16-lora8"]
)
def test_nexrl_serve_weaver_on_cuda_trains_a_run_that_raises_held_out_reward(
    tmp_path: Path, dtype: str, lora_rank: int, steps: int, rise: float
) -> None:
    with serving("weaver", tmp_path / "service", "--device", "cuda", "--dtype", dtype, "--api-key", TEST_API_KEY) as url:
        rows = train(
            tmp_path / "run",
            "backend.options.service_holder=weaver",
            f"backend.options.base_url={url}",
            "backend.options.api_key_env=NEXRL_GPU_TEST_KEY",
            f"model.dtype={dtype}",
            f"model.lora.rank={lora_rank}",
            f"schedule.steps={steps}",
            f"schedule.validate_every={steps}",
            f"schedule.checkpoint_every={steps}",
            "task.val_size=128",
            env={"NEXRL_GPU_TEST_KEY": TEST_API_KEY, "WEAVER_BASE_URL": None},
        )
    assert (rows[0]["backend/device"], rows[0]["backend/dtype"]) == ("cuda", "bfloat16" if dtype == "bf16" else "float32")
    rewards = held_out_rewards(rows)
    assert rewards[steps] >= rewards[0] + rise, f"held-out reward did not rise: {rewards}"
