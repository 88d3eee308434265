"""On a CUDA GPU: ``nexrl serve tinker --device cuda`` (fp32, and bf16 for a LoRA rank-8
run), driven by the real tinker SDK through ``nexrl train`` against its URL; the run must
raise the held-out reward, and the service must say it runs on the GPU. Skipped where torch
sees no GPU (``pytest -m gpu`` runs only these)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nexrl_testing.served_runs import SERVED_CUDA_RUNS, check_served_run_on_cuda
from nexrl_tinker.testing import TEST_API_KEY

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("dtype", "lora_rank", "steps", "rise"), SERVED_CUDA_RUNS)
def test_nexrl_serve_tinker_on_cuda_trains_a_run_that_raises_held_out_reward(
    tmp_path: Path, dtype: str, lora_rank: int, steps: int, rise: float
) -> None:
    check_served_run_on_cuda("tinker", TEST_API_KEY, tmp_path, dtype, lora_rank, steps, rise)
