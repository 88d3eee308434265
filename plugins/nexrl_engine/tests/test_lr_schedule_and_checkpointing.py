"""``algorithm.lr_schedule``/``warmup_steps`` and ``model.gradient_checkpointing`` on the
engine and the in-process backend: each step's optimizer call gets its scheduled rate,
and checkpointing (on in training passes only) leaves gradients and samples as they were."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nexrl_core.config.lr_schedule import scheduled_learning_rate
from nexrl_core.testing.rollouts import sampled_group
from nexrl_engine import Datum, Engine
from nexrl_engine.checkpointing import is_checkpointing

from tests.conftest import group_datums, open_backend, quickstart

SCHEDULE = ("schedule.steps=3", "algorithm.learning_rate=0.01", "algorithm.lr_schedule=linear", "algorithm.warmup_steps=2")
RATES = [scheduled_learning_rate(0.01, step, schedule="linear", warmup_steps=2, total_steps=3) for step in (1, 2, 3)]


def test_recipe_schedule_and_checkpointing_reach_the_engine(tmp_path: Path) -> None:
    """Each step's AdamW call on the in-process engine gets the scheduled rate (its
    ``OptimStepResult.learning_rate``, reported as ``train/lr``; the trainer logs it as
    ``optim/lr``); a trainer built afresh from the recipe, as on resume, gives step 3 the
    same. ``model.gradient_checkpointing`` reaches the training engine, not the sampler."""
    assert RATES == pytest.approx([0.005, 0.01, 0.0])
    config = quickstart(tmp_path, *SCHEDULE, "model.gradient_checkpointing=true")
    backend = open_backend(config, tmp_path / "backend")
    try:
        engine, sampler = backend.holder.engine, backend.holder.sampler  # type: ignore[attr-defined]
        assert engine.config.gradient_checkpointing and is_checkpointing(engine.model)
        assert not sampler.config.gradient_checkpointing and not is_checkpointing(sampler.model)
        group = sampled_group(backend.chat_model())
        metrics = [backend.train(group, step) for step in (1, 2, 3)]
        assert [m["optim/lr"] for m in metrics] == pytest.approx(RATES)
        assert [m["train/lr"] for m in metrics] == pytest.approx(RATES)
        fresh = type(backend.trainer)(type(backend.trainer.config).from_recipe(config))  # type: ignore[attr-defined]
        assert fresh.train(backend.holder, group, 3)["train/lr"] == pytest.approx(RATES[2])
    finally:
        backend.close()


def _gradients(engine: Engine, datums: list[Datum]) -> dict[str, torch.Tensor]:
    engine.forward_backward(datums, "importance_sampling")
    grads = {name: p.grad.detach().clone() for name, p in engine.model.named_parameters() if p.grad is not None}
    engine.zero_grad()
    return grads


def test_checkpointing_gives_the_same_gradients_recomputes_in_training_passes_only_and_samples_the_same() -> None:
    plain, checkpointed = Engine(model="nexrl-tiny"), Engine(model="nexrl-tiny", gradient_checkpointing=True)
    assert is_checkpointing(checkpointed.model) and not is_checkpointing(plain.model)
    assert not checkpointed.model.training, "the model stays in eval mode"
    mlp = checkpointed.model.model.layers[0].mlp
    calls: list[int] = []
    mlp.register_forward_pre_hook(lambda *_: calls.append(1))  # a recompute stops early, inside the layer's last module

    datums = group_datums()
    expected, got = _gradients(plain, datums), _gradients(checkpointed, datums)
    assert set(got) == set(expected) and len(got) > 0
    worst = max(float((got[name] - expected[name]).abs().max()) for name in expected)
    assert worst <= 1e-6, worst
    assert len(calls) == 2, "one training pass, its layer run again in the backward pass"
    assert not checkpointed.model.training and not any(m.training for m in checkpointed.model.modules())

    calls.clear()
    checkpointed.forward(datums[:1], "importance_sampling")
    assert len(calls) == 1, "a pass without backward recomputes nothing"
    prompt = datums[0].input_tokens[:10]
    params = {"max_tokens": 5, "seed": 11}

    def samples(engine: Engine) -> list[list[int]]:
        return [seq.tokens for seq in engine.sample([prompt], params, num_samples=2)[0].sequences]

    assert samples(checkpointed) == samples(plain)
