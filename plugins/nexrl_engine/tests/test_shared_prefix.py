"""Shared-prefix training passes: the same logprobs, entropies and gradients as the plain
pass, with each group's prompt run once."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from nexrl_engine import Engine
from nexrl_engine.loss_fns import CheckedDatum, collate, target_logprobs
from nexrl_engine.shared_prefix import plan_prefix_sharing, shared_prefix_logprobs
from nexrl_engine.types import Datum


def grpo_rows(chat_prompts: list[list[int]], groups: int, group_size: int, seed: int) -> list[list[int]]:
    """Input rows like a GRPO batch's: each prompt followed by responses of 1-8 tokens."""
    rng = random.Random(seed)
    rows = []
    for prompt in chat_prompts[:groups]:
        for _ in range(group_size):
            rows.append(prompt + [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 9))])
    return rows


def test_a_groups_rows_share_their_prompt(chat_prompts: list[list[int]]) -> None:
    rows = grpo_rows(chat_prompts, groups=3, group_size=4, seed=0)
    plan = plan_prefix_sharing(rows)
    assert plan is not None
    assert len(plan.prefix_lengths) == 3
    for row, tokens in enumerate(rows):
        group = plan.group_of_row[row]
        assert group == plan.group_of_row[(row // 4) * 4], "a group is one prompt's rows"
        assert len(chat_prompts[row // 4]) <= plan.prefix_lengths[group] + 8
        assert plan.prefix_lengths[group] < len(tokens), "every row keeps at least one token of its own"


def test_a_common_template_header_does_not_merge_different_prompts() -> None:
    header = [1, 2, 3, 4, 5, 6]
    prompts = [header + [100 + 10 * p + k for k in range(10)] for p in range(2)]
    rows = [prompt + [900 + run] for prompt in prompts for run in range(3)]
    plan = plan_prefix_sharing(rows)
    assert plan is not None
    assert plan.group_of_row == [0, 0, 0, 1, 1, 1] and plan.prefix_lengths == [16, 16]


def test_no_plan_when_nothing_is_shared() -> None:
    assert plan_prefix_sharing([[1, 2, 3], [4, 5, 6], [7, 8]]) is None
    assert plan_prefix_sharing([[5, 6, 7, 8]]) is None


def test_singletons_and_one_token_rows_get_a_prefix_of_at_least_one_token() -> None:
    rows = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]] * 6 + [[40, 41, 42], [9]]
    plan = plan_prefix_sharing(rows)
    assert plan is not None
    by_row = [plan.prefix_lengths[group] for group in plan.group_of_row]
    assert by_row == [11] * 6 + [2, 1]


def double_engine_copy(engine: Engine) -> torch.nn.Module:
    return copy.deepcopy(engine.model).double()


@pytest.mark.parametrize("with_entropy", [False, True])
def test_logprobs_entropy_and_gradients_equal_the_plain_pass(
    shared_engine: Engine, chat_prompts: list[list[int]], with_entropy: bool
) -> None:
    """In float64 the two passes agree to rounding (Qwen2's RMSNorm still computes in
    float32, hence the gradient tolerance), so any indexing mistake would show."""
    model = double_engine_copy(shared_engine)
    rows = grpo_rows(chat_prompts, groups=4, group_size=5, seed=2) + [[7], [3, 9, 11]]
    chunk = [CheckedDatum(row[:-1] or row, {"target_tokens": (row[1:] or row)}) for row in rows]
    batch = collate(chunk, shared_engine.pad_token_id, torch.device("cpu"))
    plan = plan_prefix_sharing([datum.input_tokens for datum in chunk])
    assert plan is not None
    weights = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    real = batch.attention_mask.bool()

    def run(shared: bool) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        if shared:
            logprobs, entropy = shared_prefix_logprobs(model, batch, plan, shared_engine.pad_token_id, with_entropy)
        else:
            logprobs, entropy = target_logprobs(model, batch, with_entropy)
        logprobs = torch.where(real, logprobs.double(), 0.0)
        loss = (logprobs * weights).sum()
        if entropy is not None:
            entropy = torch.where(real, entropy.double(), 0.0)
            loss = loss + 0.1 * entropy.sum()
        loss.backward()
        return (
            logprobs.detach(),
            None if entropy is None else entropy.detach(),
            [p.grad.clone() for p in model.parameters() if p.grad is not None],
        )

    plain, shared = run(False), run(True)
    assert torch.allclose(plain[0], shared[0], atol=1e-10)
    if with_entropy:
        assert torch.allclose(plain[1], shared[1], atol=1e-10)
    assert len(plain[2]) == len(shared[2]) > 0
    for a, b in zip(plain[2], shared[2]):
        assert torch.allclose(a, b, atol=1e-6 * float(a.abs().max()), rtol=1e-5), (a - b).abs().max().item()


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_the_engine_trains_the_same_with_and_without_sharing(chat_prompts: list[list[int]], lora_rank: int) -> None:
    rows = grpo_rows(chat_prompts, groups=3, group_size=4, seed=4)
    rng = random.Random(5)
    datums = []
    for index, row in enumerate(rows):
        prompt = len(chat_prompts[index // 4])
        n = len(row) - 1
        advantage = rng.uniform(-1, 1)
        datums.append(
            Datum(
                input_tokens=row[:-1],
                loss_fn_inputs={
                    "target_tokens": row[1:],
                    "logprobs": [-2.0] * n,
                    "advantages": [0.0] * (prompt - 1) + [advantage] * (n - prompt + 1),
                },
            )
        )
    results = []
    for share in (False, True):
        engine = Engine(model="nexrl-tiny", seed=0, share_prefixes=share, lora={"rank": lora_rank})
        first = engine.forward_backward(datums, "ppo")
        engine.optim_step({"learning_rate": 1e-3})
        results.append((first, engine.forward(datums, "ppo")))
    (plain_first, plain_after), (shared_first, shared_after) = results
    for plain, shared in ((plain_first, shared_first), (plain_after, shared_after)):
        assert plain.metrics.keys() == shared.metrics.keys()
        for key, value in plain.metrics.items():
            assert shared.metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
        for a, b in zip(plain.outputs, shared.outputs):
            assert b.logprobs == pytest.approx(a.logprobs, rel=1e-4, abs=1e-4)
    assert plain_after.metrics["loss:sum"] != pytest.approx(plain_first.metrics["loss:sum"], rel=1e-6)
