"""On a CUDA GPU: the in-process backend trains the shipped model (fp32; bf16 with LoRA
rank 8; bf16 compute over fp32 masters) and raises the held-out reward, the GPU
sampler's greedy replies on the shipped model are the CPU sampler's, and a batch of
prompts that sample differently gives each what it gets alone. Skipped where torch sees
no GPU (``make test-gpu``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nexrl_engine import Engine
from nexrl_engine.types import SamplingParams
from nexrl_testing.served_runs import held_out_rewards, train

pytestmark = pytest.mark.gpu

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "quickstart_inprocess.yaml"


@pytest.mark.parametrize(
    ("precision", "steps", "rise"),
    [([], 10, 0.2), (["model.dtype=bf16", "model.lora.rank=8"], 12, 0.15)],
    ids=["fp32", "bf16-lora8"],
)
def test_the_inprocess_backend_on_cuda_raises_held_out_reward(tmp_path: Path, precision: list[str], steps: int, rise: float) -> None:
    rows = train(
        tmp_path / "run",
        "backend.options.device=cuda",
        *precision,
        f"schedule.steps={steps}",
        f"schedule.validate_every={steps}",
        f"schedule.checkpoint_every={steps}",
        "task.val_size=128",
        recipe=RECIPE,
    )
    assert rows[0]["backend/device"].startswith("cuda")
    rewards = held_out_rewards(rows)
    assert rewards[steps] >= rewards[0] + rise, f"held-out reward did not rise: {rewards}"


def test_mixed_precision_on_cuda_raises_held_out_reward(tmp_path: Path) -> None:
    """bf16 compute over fp32 masters (``model.mixed_precision``) trains on the GPU: the run
    reports both dtypes, and held-out reward rises as much as the fp32 run's must."""
    steps = 10
    rows = train(
        tmp_path / "run", "backend.options.device=cuda", "model.dtype=bf16", "model.mixed_precision=true", f"schedule.steps={steps}",
        f"schedule.validate_every={steps}", f"schedule.checkpoint_every={steps}", "task.val_size=128", recipe=RECIPE,
    )  # fmt: skip
    assert rows[0]["backend/device"].startswith("cuda")
    assert (rows[0]["backend/dtype"], rows[0]["backend/master_dtype"]) == ("bfloat16", "float32")
    rewards = held_out_rewards(rows)
    assert rewards[steps] >= rewards[0] + 0.2, f"held-out reward did not rise: {rewards}"


def test_greedy_replies_on_the_gpu_are_the_cpus(chat_prompts: list[list[int]]) -> None:
    """Same tokens at temperature 0; logprobs within 1e-3 (float rounding on another device
    may split a near-tie, which would show as a different token)."""
    params = SamplingParams(max_tokens=12, temperature=0.0)
    on_cpu = Engine(model="nexrl-tiny", seed=0).sample(chat_prompts, params, num_samples=2)
    on_gpu = Engine(model="nexrl-tiny", seed=0, device="cuda").sample(chat_prompts, params, num_samples=2)
    for cpu_prompt, gpu_prompt in zip(on_cpu, on_gpu):
        for cpu, gpu in zip(cpu_prompt.sequences, gpu_prompt.sequences):
            assert gpu.tokens == cpu.tokens
            torch.testing.assert_close(torch.tensor(gpu.logprobs), torch.tensor(cpu.logprobs), atol=1e-3, rtol=0)


def test_a_mixed_batch_on_the_gpu_samples_each_prompt_as_if_alone(chat_prompts: list[list[int]]) -> None:
    """Prompts with their own temperature, filters, budgets and stops in one decode loop on
    the CUDA path (static cache, captured step): each prompt's tokens are those it gets
    alone on the GPU, logprobs within 1e-3."""
    engine = Engine(model="nexrl-tiny", seed=0, device="cuda")
    mixed = [
        SamplingParams(temperature=0.0, max_tokens=6),
        SamplingParams(temperature=1.0, top_k=5, max_tokens=24, seed=11),
        SamplingParams(temperature=0.7, top_p=0.8, max_tokens=16, stop=["1"], seed=12),
        SamplingParams(temperature=1.3, max_tokens=20, stop=[], seed=13),
    ]
    prompts = chat_prompts[: len(mixed)]
    together = engine.sample(prompts, mixed, num_samples=2)
    for prompt, params, batched in zip(prompts, mixed, together):
        (alone,) = engine.sample([prompt], params, num_samples=2)
        for own, shared in zip(alone.sequences, batched.sequences):
            assert (shared.tokens, shared.stop_reason) == (own.tokens, own.stop_reason)
            torch.testing.assert_close(torch.tensor(shared.logprobs), torch.tensor(own.logprobs), atol=1e-3, rtol=0)
