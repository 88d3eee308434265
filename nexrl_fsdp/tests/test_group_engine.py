"""`WorkerGroupEngine`: a model on a worker group (2 gloo ranks on the loopback) behaves
as an `Engine` does, and refuses what an engine refuses, with the same words.

One group serves the module; tests run in file order and keep an engine in step with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import torch
from safetensors.torch import load_file

from nexrl_core.config.adamw import AdamWSettings
from nexrl_core.config.lora import LoraSettings
from nexrl_core.training.worker_groups import GroupSettings
from nexrl_engine import Datum, Engine
from nexrl_engine import checkpoint as ckpt
from nexrl_engine.config import TrainingSpec
from nexrl_engine.lora import merged_copy
from nexrl_engine.loss_fns import build_loss_fn, check_datums
from nexrl_fsdp.direct_zmq.datums import datum_tensors, tensor_datums
from nexrl_fsdp.local_placer import LocalPlacer
from nexrl_fsdp.worker.datum_ops import rank_shares
from nexrl_fsdp.worker_groups import WorkerGroupEngine

BASE = "nexrl-tiny"
SETTINGS = AdamWSettings(learning_rate=0.05, beta1=0.5, beta2=0.6, eps=1e-3, weight_decay=0.3, grad_clip_norm=0.01)
"""Every field far from its default. A large eps keeps Adam from blowing rounding in
near-zero gradients up to a full step, so a large rate stays comparable; it also makes
the update follow the gradient's scale, so the clipping shows."""


def datums(count: int, seed: int = 0) -> list[Datum]:
    """RL datums of different lengths; every other one has a loss mask of its own."""
    generator = torch.Generator().manual_seed(seed)
    made = []
    for index in range(count):
        n = 4 + 3 * index
        inputs = {
            "target_tokens": torch.randint(5, 900, (n,), generator=generator).tolist(),
            "logprobs": (-torch.rand(n, generator=generator) * 4).tolist(),
            "advantages": torch.randn(n, generator=generator).tolist(),
        }
        if index % 2:
            inputs["mask"] = [0.0] * (n // 2) + [1.0] * (n - n // 2)
        made.append(Datum(input_tokens=torch.randint(5, 900, (n,), generator=generator).tolist(), loss_fn_inputs=inputs))
    return made


@pytest.fixture(scope="module")
def base_sampler() -> Engine:
    return Engine(model=BASE)


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory, base_sampler: Engine) -> Iterator[WorkerGroupEngine]:
    settings = GroupSettings(ranks=2, threads_per_rank=1, log_dir=tmp_path_factory.mktemp("groups"), placer=LocalPlacer())
    engine = WorkerGroupEngine("group-test", TrainingSpec(BASE), "fp32", settings, lambda: base_sampler)
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def twin() -> Engine:
    """An engine that takes the same steps as the group."""
    return Engine(model=BASE)


def max_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p - q).abs().max()) for (_, p), (_, q) in zip(a.named_parameters(), b.named_parameters()))


def test_datums_cross_the_wire_unchanged() -> None:
    sent = check_datums(datums(5), build_loss_fn("ppo"), 1000)
    received = check_datums(tensor_datums(datum_tensors(sent)), build_loss_fn("ppo"), 1000)
    assert [d.input_tokens for d in received] == [d.input_tokens for d in sent]
    for one, two in zip(sent, received):
        assert set(one.values) == set(two.values)
        for key, values in one.values.items():
            assert two.values[key] == pytest.approx(values)


def test_malformed_datum_tensors_are_refused_by_name() -> None:
    tensors = datum_tensors(check_datums(datums(3), build_loss_fn("ppo"), 1000))
    with pytest.raises(ValueError, match="'value:advantages' holds"):
        tensor_datums({**tensors, "value:advantages": tensors["value:advantages"][:-1]})
    with pytest.raises(ValueError, match="input_tokens holds"):
        tensor_datums({**tensors, "input_tokens": tensors["input_tokens"][1:]})


def test_rank_shares_are_contiguous_balanced_and_cover_every_datum() -> None:
    lengths = [5, 40, 3, 3, 30, 10, 9]
    for world in (1, 2, 3, 4, 9):
        shares = rank_shares(lengths, world)
        assert [i for share in shares for i in share] == list(range(len(lengths)))
    two = rank_shares(lengths, 2)
    assert abs(sum(lengths[i] for i in two[0]) - sum(lengths[i] for i in two[1])) <= 40
    assert [list(share) for share in rank_shares([7], 2)] == [[0], []]
    assert list(rank_shares([100, 1, 1], 3)[0]) == [0]  # rank 0 always has one


def test_steps_with_uneven_passes_per_rank_equal_the_engine(group: WorkerGroupEngine, twin: Engine) -> None:
    """Micro-batches of few tokens: one rank runs more passes than the other, and one
    request has a single datum (one rank has none). Losses, outputs, metrics and the
    weights after two steps with every AdamW field set are the engine's."""
    group.config = attrs.evolve(group.config, max_tokens_per_microbatch=24)
    twin.config = attrs.evolve(twin.config, max_tokens_per_microbatch=24)
    for step, batch in enumerate((datums(6, seed=1), datums(1, seed=2))):
        config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.3}
        expected = twin.forward_backward(batch, "ppo", config)
        got = group.forward_backward(batch, "ppo", config)
        assert got.metrics == pytest.approx(expected.metrics, rel=1e-4, abs=1e-6), f"step {step}"
        for a, b in zip(expected.outputs, got.outputs):
            assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)
        stepped, expected_step = group.optim_step(SETTINGS), twin.optim_step(SETTINGS)
        assert (stepped.step, stepped.skipped, stepped.clipped) == (expected_step.step, expected_step.skipped, expected_step.clipped)
        assert stepped.grad_norm == pytest.approx(expected_step.grad_norm, rel=1e-4)
        exported = group.sampler()
        assert max_difference(exported.model, twin.model) < 1e-5, f"weights after step {step}"


def test_the_export_is_the_engines(group: WorkerGroupEngine, twin: Engine, tmp_path: Path) -> None:
    """Rank 0 writes the files `Engine.export_hf` writes: the same names (a tied head
    once) and the same weights."""
    written = {
        side.__class__.__name__: load_file(str(side.export_hf(tmp_path / side.__class__.__name__) / "model.safetensors"))
        for side in (group, twin)
    }
    ours, theirs = written["WorkerGroupEngine"], written["Engine"]
    assert set(ours) == set(theirs)
    assert max(float((ours[name] - theirs[name]).abs().max()) for name in ours) < 1e-5


@pytest.mark.parametrize("field", [field.name for field in attrs.fields(AdamWSettings)])
def test_every_adamw_field_reaches_the_group(group: WorkerGroupEngine, twin: Engine, field: str) -> None:
    """Two steps with ``field`` at its value in SETTINGS end where the engine ends, and
    the same steps with that field at its default end elsewhere: the field arrived.
    Cross-entropy on random targets gives gradients far above the clipping norm, so
    every field, the clipping included, shows in the weights."""
    twin_state = group.log_path.parent / f"before-{field}"
    twin.save_state(twin_state)
    group.load_state(twin_state)
    default = attrs.evolve(SETTINGS, **{field: attrs.fields_dict(AdamWSettings)[field].default})
    batch = datums(3, seed=3)
    for _ in range(2):
        twin.forward_backward(batch, "cross_entropy")
        group.forward_backward(batch, "cross_entropy")
        twin.optim_step(SETTINGS)
        group.optim_step(SETTINGS)
    assert max_difference(group.sampler().model, twin.model) < 1e-5
    other = Engine(model=BASE)
    other.load_state(twin_state)
    for _ in range(2):
        other.forward_backward(batch, "cross_entropy")
        other.optim_step(default)
    assert max_difference(other.model, twin.model) > 1e-4, f"{field} makes no difference in this test"


def test_bad_requests_are_refused_as_the_engine_refuses_them(group: WorkerGroupEngine, tmp_path: Path) -> None:
    bad = [Datum(input_tokens=[1, 2, 3], loss_fn_inputs={"target_tokens": [2, 3, 10**6]})]
    with pytest.raises(ValueError, match=r"datum 0: token ids \[1000000\] are outside the vocabulary"):
        group.forward(bad, "cross_entropy")
    with pytest.raises(ValueError, match="unknown loss_fn 'no-such-loss'"):
        group.forward(datums(1), "no-such-loss")
    with pytest.raises(ValueError, match="unknown AdamW fields"):
        group.optim_step({"learning_rate": 1e-3, "momentum": 0.9})
    other = Engine(model=BASE, lora=LoraSettings(rank=2))
    other.save_state(tmp_path / "lora")
    with pytest.raises(ValueError, match="has LoRA settings"):
        group.load_state(tmp_path / "lora")
    assert group.forward(datums(1), "cross_entropy").metrics["num_sequences:sum"] == 1.0  # still serving


def test_a_lora_model_on_a_group_steps_saves_and_loads_as_the_engine(tmp_path: Path, base_sampler: Engine) -> None:
    """LoRA with every target on a 2-rank group: the adapters start as the engine's
    (same seed), two steps end at the engine's adapters and optimizer moments, the
    states load into each other, and the group's sampler is the engine's merged model."""
    spec = TrainingSpec(BASE, lora=LoraSettings(rank=4, alpha=8.0), lora_seed=5)
    twin = Engine(spec.engine_config("fp32"))
    settings = GroupSettings(ranks=2, threads_per_rank=1, log_dir=tmp_path / "logs", placer=LocalPlacer())
    group = WorkerGroupEngine("lora", spec, "fp32", settings, lambda: base_sampler)
    try:
        for seed in (4, 5):
            batch = datums(4, seed=seed)
            expected, got = twin.forward_backward(batch, "ppo"), group.forward_backward(batch, "ppo")
            assert got.metrics == pytest.approx(expected.metrics, rel=1e-4, abs=1e-6)
            assert group.optim_step(SETTINGS).grad_norm == pytest.approx(twin.optim_step(SETTINGS).grad_norm, rel=1e-4)
        group.save_state(tmp_path / "group")
        twin.save_state(tmp_path / "engine")
        assert ckpt.read_manifest(tmp_path / "group") == ckpt.read_manifest(tmp_path / "engine")
        for read in (ckpt.read_weights, ckpt.read_optimizer):
            ours, theirs = read(tmp_path / "group"), read(tmp_path / "engine")
            assert set(ours) == set(theirs) and all("lora_" in name for name in ckpt.read_weights(tmp_path / "engine"))
            assert max(float((ours[name] - theirs[name]).abs().max()) for name in ours) < 1e-5
        merged = merged_copy(twin._peft)
        assert max_difference(group.sampler().model, merged) < 1e-5
        group.load_state(tmp_path / "engine")
        Engine(model=BASE).save_state(tmp_path / "full")
        with pytest.raises(ValueError, match="has LoRA settings"):
            group.load_state(tmp_path / "full")
    finally:
        group.stop()
