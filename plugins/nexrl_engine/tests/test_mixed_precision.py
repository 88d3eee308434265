"""``model.mixed_precision`` on the engine and the in-process backend: fp32 master weights
and AdamW moments under bfloat16 compute.

What it buys is checked against an fp32 run, independently of the engine's own account:
updates below bfloat16's resolution, which pure bfloat16 rounds away, move the masters as
they move fp32 weights. One mixed-precision step is the fp32 step within bfloat16's
rounding; LoRA adapters train in fp32 on a bfloat16 base; checkpoints round-trip the
masters and moments bit for bit; sampling and exports get the bfloat16 weights the
masters round to.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nexrl_core.config.adamw import AdamWSettings
from nexrl_core.config.lora import LoraSettings
from nexrl_core.testing.rollouts import sampled_group
from nexrl_engine import Engine
from nexrl_engine.checkpoint import MANIFEST_NAME, OPTIMIZER_NAME, WEIGHTS_NAME
from nexrl_engine.config import EngineConfig
from nexrl_testing.bf16_bounds import (
    BF16_VISIBLE,
    GRAD_NORM_RELATIVE,
    LOGPROB_TOLERANCE,
    abs_advantages,
    loss_tolerance,
    max_logprob_gap,
    trained_tokens,
)

from tests.conftest import group_datums, open_backend, quickstart

TINY_RATE = AdamWSettings(learning_rate=1e-5)
"""An update of about 1e-5 a weight: under half a bfloat16 step of most of the tiny
model's weights (their size is around 0.02, where a bfloat16 step is about 1.2e-4)."""


def _snapshot(engine: Engine) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in engine.trained_parameters().items()}


def _update(engine: Engine, start: dict[str, torch.Tensor]) -> torch.Tensor:
    """Everything the engine's trained weights moved since ``start``, as one fp32 vector."""
    now = engine.trained_parameters()
    return torch.cat([(now[name].detach().float() - start[name].float()).flatten() for name in start])


def _train(engine: Engine, steps: int, settings: AdamWSettings) -> None:
    for _ in range(steps):
        engine.forward_backward(group_datums(), "importance_sampling")
        engine.optim_step(settings)


def _assert_computes_with_the_rounded_masters(engine: Engine) -> None:
    masters = engine.trained_parameters()
    computed = dict(engine.model.named_parameters())
    for name, master in masters.items():
        assert master.dtype == torch.float32 and computed[name].dtype == torch.bfloat16, name
        assert torch.equal(computed[name].detach(), master.detach().to(torch.bfloat16)), name


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm() / expected.norm())


def test_the_masters_keep_the_updates_pure_bf16_rounds_away() -> None:
    """Three steps at a rate below bfloat16's resolution: fp32 weights move by some update
    U. Pure bfloat16 weights lose most of it (what is left is whole bfloat16 steps of the
    smallest weights); the mixed-precision masters move by U, to within the difference
    between bfloat16 and fp32 gradients."""
    fp32 = Engine(model="nexrl-tiny")
    pure = Engine(model="nexrl-tiny", dtype="bf16")
    mixed = Engine(model="nexrl-tiny", dtype="bf16", mixed_precision=True)
    starts = {engine: _snapshot(engine) for engine in (fp32, pure, mixed)}
    for engine in (fp32, pure, mixed):
        _train(engine, 3, TINY_RATE)
    expected = _update(fp32, starts[fp32])
    assert float(expected.norm()) > 0
    assert _relative(_update(pure, starts[pure]), expected) > 0.9, "pure bf16 keeps the small updates: the check is not testing resolution"
    assert _relative(_update(mixed, starts[mixed]), expected) < 0.1
    assert mixed.trained_dtype() == "float32" and mixed.compute_dtype() == "bfloat16"
    assert {str(t.dtype) for t in mixed._optimizer.state_tensors().values()} == {"torch.float32"}  # type: ignore[union-attr]
    _assert_computes_with_the_rounded_masters(mixed)


def test_one_mixed_precision_step_is_the_fp32_step_within_bf16_rounding() -> None:
    """The per-token log-probs, the loss and the gradient of one pass (on the masters, in
    fp32, the compute copy's freed) are the fp32 engine's to bfloat16's precision, bounded
    as any CPU's kernels may round (`nexrl_testing.bf16_bounds`); the step then leaves the
    model computing with the masters rounded to bfloat16."""
    fp32 = Engine(model="nexrl-tiny")
    mixed = Engine(model="nexrl-tiny", dtype="bf16", mixed_precision=True)
    datums = group_datums()
    terms = fp32.forward(abs_advantages(datums), "importance_sampling").metrics["loss:sum"]
    expected = fp32.forward_backward(datums, "importance_sampling")
    got = mixed.forward_backward(datums, "importance_sampling")
    masks = [datum.loss_fn_inputs["mask"] for datum in datums]
    gap = max_logprob_gap(
        trained_tokens([o.logprobs for o in got.outputs], masks), trained_tokens([o.logprobs for o in expected.outputs], masks)
    )
    assert BF16_VISIBLE < gap <= LOGPROB_TOLERANCE, "the pass computes in bfloat16, within its rounding"
    assert abs(got.metrics["loss:sum"] - expected.metrics["loss:sum"]) <= loss_tolerance(terms, gap), "the loss is of these log-probs"
    masters, reference = mixed.trained_parameters(), fp32.trained_parameters()
    assert all(parameter.grad is None for parameter in mixed.model.parameters()), "bf16 gradients are freed once collected"
    assert {master.grad.dtype for master in masters.values()} == {torch.float32}  # type: ignore[union-attr]
    got_grad = torch.cat([masters[name].grad.flatten() for name in reference])  # type: ignore[union-attr]
    expected_grad = torch.cat([reference[name].grad.flatten() for name in reference])  # type: ignore[union-attr]
    assert _relative(got_grad, expected_grad) < 0.08  # measured 0.035: bf16 activations and gradients
    assert mixed.optim_step(TINY_RATE).grad_norm == pytest.approx(fp32.optim_step(TINY_RATE).grad_norm, rel=GRAD_NORM_RELATIVE)
    _assert_computes_with_the_rounded_masters(mixed)


def test_gradients_of_several_passes_add_up_in_fp32() -> None:
    """Two forward_backward calls before a step give the masters the sum of both passes'
    gradients (the second is added to the first, not put in its place)."""
    mixed = Engine(model="nexrl-tiny", dtype="bf16", mixed_precision=True)
    datums = group_datums()
    mixed.forward_backward(datums[:2], "importance_sampling")
    first = {name: master.grad.clone() for name, master in mixed.trained_parameters().items()}  # type: ignore[union-attr]
    mixed.forward_backward(datums[2:], "importance_sampling")
    both = {name: master.grad.clone() for name, master in mixed.trained_parameters().items()}  # type: ignore[union-attr]
    mixed.zero_grad()
    mixed.forward_backward(datums[2:], "importance_sampling")
    second = {name: master.grad for name, master in mixed.trained_parameters().items()}
    for name in both:
        torch.testing.assert_close(both[name], first[name] + second[name], rtol=0, atol=1e-6)
    mixed.zero_grad()
    assert all(master.grad is None for master in mixed.trained_parameters().values())


def test_lora_trains_fp32_adapters_on_a_bf16_base() -> None:
    """With LoRA only the adapters have masters (fp32, with fp32 moments); the frozen base
    is bfloat16 alone, and the adapters compute in bfloat16 too (rounded from the
    masters). Two steps move the adapters' masters as the fp32 engine moves its adapters."""
    lora = LoraSettings(rank=4)
    fp32 = Engine(EngineConfig(model="nexrl-tiny", lora=lora))
    mixed = Engine(EngineConfig(model="nexrl-tiny", lora=lora, dtype="bf16", mixed_precision=True))
    masters = mixed.trained_parameters()
    assert masters and all("lora_" in name for name in masters)
    assert {p.dtype for name, p in mixed.model.named_parameters() if name not in masters} == {torch.bfloat16}
    starts = {engine: _snapshot(engine) for engine in (fp32, mixed)}
    settings = AdamWSettings(learning_rate=1e-3)
    for engine in (fp32, mixed):
        _train(engine, 2, settings)
    assert _relative(_update(mixed, starts[mixed]), _update(fp32, starts[fp32])) < 0.15  # measured 0.073: the bf16 base
    assert {str(t.dtype) for t in mixed._optimizer.state_tensors().values()} == {"torch.float32"}  # type: ignore[union-attr]
    _assert_computes_with_the_rounded_masters(mixed)


def test_a_checkpoint_round_trips_the_fp32_masters_and_moments(tmp_path: Path) -> None:
    """The checkpoint holds the masters and AdamW moments in fp32, exactly; an engine that
    loads it computes with them rounded and takes the next step bit for bit as the saved
    one does. A pure bfloat16 engine loads the masters rounded."""
    mixed = Engine(model="nexrl-tiny", dtype="bf16", mixed_precision=True)
    _train(mixed, 2, TINY_RATE)
    mixed.save_state(tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / MANIFEST_NAME).read_text())["dtype"] == "float32"
    saved = load_file(str(tmp_path / "ckpt" / WEIGHTS_NAME))
    masters = _snapshot(mixed)
    assert saved.keys() == masters.keys() and all(torch.equal(saved[name], masters[name]) for name in masters)
    moments = load_file(str(tmp_path / "ckpt" / OPTIMIZER_NAME))
    assert {tensor.dtype for name, tensor in moments.items() if not name.endswith("::step")} == {torch.float32}

    resumed = Engine(model="nexrl-tiny", dtype="bf16", mixed_precision=True)
    resumed.load_state(tmp_path / "ckpt")
    _assert_computes_with_the_rounded_masters(resumed)
    assert all(torch.equal(resumed.trained_parameters()[name], masters[name]) for name in masters)
    for engine in (mixed, resumed):
        _train(engine, 1, TINY_RATE)
    after, again = mixed.trained_parameters(), resumed.trained_parameters()
    assert all(torch.equal(again[name], after[name]) for name in after), "the same moments give the same next step"

    pure = Engine(model="nexrl-tiny", dtype="bf16")
    pure.load_state(tmp_path / "ckpt", load_optimizer=False)
    assert all(torch.equal(pure.trained_parameters()[name], masters[name].to(torch.bfloat16)) for name in masters)


def test_the_export_writes_the_bf16_weights_the_model_computes_with(tmp_path: Path) -> None:
    mixed = Engine(model="nexrl-tiny", dtype="bf16", mixed_precision=True)
    _train(mixed, 1, AdamWSettings(learning_rate=1e-3))
    mixed.export_hf(tmp_path / "hf")
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    masters = mixed.trained_parameters()
    assert {tensor.dtype for tensor in exported.values()} == {torch.bfloat16}
    assert all(torch.equal(exported[name], masters[name].detach().to(torch.bfloat16)) for name in exported)


def test_mixed_precision_needs_bfloat16() -> None:
    with pytest.raises(ValueError, match="mixed_precision needs dtype bfloat16"):
        EngineConfig(model="nexrl-tiny", mixed_precision=True)


def test_the_recipe_key_reaches_the_inprocess_engine_and_sampling_uses_the_rounded_masters(tmp_path: Path) -> None:
    """``model.mixed_precision`` gives the training engine fp32 masters and leaves the
    sampler a bfloat16 model without any; after a step and a publish the sampler holds
    the masters rounded, the run reports both dtypes, the checkpoint holds the masters
    and the export the sampler's bfloat16 weights."""
    backend = open_backend(quickstart(tmp_path, "model.dtype=bf16", "model.mixed_precision=true"), tmp_path / "backend")
    try:
        holder = backend.holder
        engine, sampler = holder.engine, holder.sampler  # type: ignore[attr-defined]
        assert engine.config.mixed_precision and not sampler.config.mixed_precision
        assert backend.run_info() == {"dtype": "bfloat16", "master_dtype": "float32", "device": "cpu"}
        assert {p.dtype for p in sampler.model.parameters()} == {torch.bfloat16}
        before = _snapshot(engine)
        metrics = backend.train(sampled_group(backend.chat_model()), 1)
        assert metrics["train/grad_norm"] > 0
        assert any(not torch.equal(engine.trained_parameters()[name], before[name]) for name in before)
        holder.update_sampling_weights()
        masters = engine.trained_parameters()
        published = dict(sampler.model.named_parameters())
        assert all(torch.equal(published[name].detach(), masters[name].detach().to(torch.bfloat16)) for name in masters)
        checkpoint = json.loads(Path(backend.save_checkpoint("step1")).read_text())["holder"]
        assert {t.dtype for t in load_file(str(Path(checkpoint) / WEIGHTS_NAME)).values()} == {torch.float32}
        exported = load_file(str(backend.export_model(tmp_path / "export") / "model.safetensors"))
        assert all(torch.equal(exported[name], published[name].detach()) for name in exported)
    finally:
        backend.close()
