"""Save/load round trips (with and without optimizer state) and merged HF exports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nexrl_engine import Datum, Engine
from nexrl_engine.checkpoint import MANIFEST_NAME, OPTIMIZER_NAME, WEIGHTS_NAME

DATA = [
    Datum(input_tokens=[1, 40, 50, 60, 70], loss_fn_inputs={"target_tokens": [40, 50, 60, 70, 2], "weights": [0, 1, 1, 1, 1]}),
    Datum(input_tokens=[1, 41, 51], loss_fn_inputs={"target_tokens": [41, 51, 2], "weights": [0, 1, 1]}),
]
PROBE = torch.tensor([[1, 40, 50, 60, 70, 80, 90]])


def _train(engine: Engine, steps: int) -> None:
    for _ in range(steps):
        engine.forward_backward(DATA, "cross_entropy")
        engine.optim_step(learning_rate=1e-3, weight_decay=0.01)


def _weights(engine: Engine) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in engine.model.named_parameters()}


def _logits(engine: Engine) -> torch.Tensor:
    with torch.no_grad():
        return engine.model(input_ids=PROBE).logits


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_round_trip_with_optimizer(engine: Engine, tmp_path: Path) -> None:
    _train(engine, 2)
    engine.save_state(tmp_path / "ckpt")
    manifest = json.loads((tmp_path / "ckpt" / MANIFEST_NAME).read_text())
    assert manifest["base_model"] == "nexrl-tiny" and manifest["step"] == 2 and manifest["has_optimizer"]
    assert manifest["lora"] is None and manifest["dtype"] == "float32"
    _train(engine, 1)
    expected = _weights(engine)

    resumed = Engine(model="nexrl-tiny")
    loaded = resumed.load_state(tmp_path / "ckpt")
    assert loaded.step == 2 and resumed.step == 2
    _train(resumed, 1)
    _assert_same(_weights(resumed), expected)  # same moments → the same next step, bit for bit


def test_round_trip_without_optimizer(engine: Engine, tmp_path: Path) -> None:
    _train(engine, 2)
    saved = _weights(engine)
    engine.save_state(tmp_path / "weights_only", include_optimizer=False)
    assert not (tmp_path / "weights_only" / OPTIMIZER_NAME).exists()

    fresh = Engine(model="nexrl-tiny")
    with pytest.raises(ValueError, match="saved without optimizer state"):
        fresh.load_state(tmp_path / "weights_only")
    fresh.load_state(tmp_path / "weights_only", load_optimizer=False)
    _assert_same(_weights(fresh), saved)
    assert fresh.step == 0

    # Loading a checkpoint that has optimizer state but asking for weights only also works.
    engine.save_state(tmp_path / "full")
    other = Engine(model="nexrl-tiny")
    other.load_state(tmp_path / "full", load_optimizer=False)
    _assert_same(_weights(other), saved)


def test_checkpoint_files_are_safetensors(engine: Engine, tmp_path: Path) -> None:
    _train(engine, 1)
    directory = engine.save_state(tmp_path / "c")
    names = sorted(p.name for p in directory.iterdir())
    assert names == sorted([MANIFEST_NAME, WEIGHTS_NAME, OPTIMIZER_NAME])
    from safetensors.torch import load_file

    optimizer = load_file(str(directory / OPTIMIZER_NAME))
    assert any(key.endswith("::exp_avg_sq") for key in optimizer)


def test_export_then_load_gives_identical_logits(engine: Engine, tmp_path: Path) -> None:
    _train(engine, 2)
    exported = engine.export_hf(tmp_path / "hf")
    assert (exported / "config.json").is_file() and (exported / "tokenizer.json").is_file()
    reloaded = Engine(model=str(exported))
    assert torch.equal(_logits(reloaded), _logits(engine))
    assert reloaded.tokenizer.chat_template == engine.tokenizer.chat_template


def test_export_sampler_equals_loading_the_export(engine: Engine, tmp_path: Path) -> None:
    """What a service hands its sampler from memory is what it would load from disk."""
    _train(engine, 2)
    sampler = engine.export_sampler(tmp_path / "hf")
    reloaded = Engine(model=str(tmp_path / "hf"))
    assert torch.equal(_logits(sampler), _logits(reloaded))
    assert (sampler.base_model_id, sampler.eos_token_ids, sampler.pad_token_id) == (
        reloaded.base_model_id,
        reloaded.eos_token_ids,
        reloaded.pad_token_id,
    )
    params = {"max_tokens": 6, "temperature": 1.0, "seed": 3}
    together = zip(*(e.sample([[1, 40, 50]], params, num_samples=3)[0].sequences for e in (sampler, reloaded)))
    for ours, loaded in together:
        assert ours.tokens == loaded.tokens
        assert ours.logprobs == pytest.approx(loaded.logprobs, abs=1e-5)  # same weights, other memory layout
    # The copy is independent: training on does not move the sampler's weights.
    before = _logits(sampler)
    _train(engine, 1)
    assert torch.equal(_logits(sampler), before) and not torch.equal(_logits(engine), before)


def test_export_sampler_reuses_the_weights_of_samplers_nobody_holds(engine: Engine, tmp_path: Path) -> None:
    first = engine.export_sampler(tmp_path / "a")
    first_model = first.model
    _train(engine, 1)
    second = engine.export_sampler(tmp_path / "b")
    assert second.model is not first_model, "a live sampler's weights are never overwritten"
    assert torch.equal(_logits(first), _logits(Engine(model=str(tmp_path / "a"))))
    del first
    _train(engine, 1)
    third = engine.export_sampler(tmp_path / "c")
    assert third.model is first_model, "the dropped sampler's model is reused"
    assert torch.equal(_logits(third), _logits(engine))
    assert torch.equal(_logits(third), _logits(Engine(model=str(tmp_path / "c"))))
    assert not torch.equal(_logits(second), _logits(third))


def test_load_rejects_other_base_or_garbage(engine: Engine, tmp_path: Path) -> None:
    engine.save_state(tmp_path / "full")
    lora = Engine(model="nexrl-tiny", lora={"rank": 2})
    with pytest.raises(ValueError, match="LoRA settings"):
        lora.load_state(tmp_path / "full")
    exported = engine.export_hf(tmp_path / "hf")
    other_base = Engine(model=str(exported))
    with pytest.raises(ValueError, match="base model 'nexrl-tiny'"):
        other_base.load_state(tmp_path / "full")
    with pytest.raises(ValueError, match="not a NexRL engine checkpoint"):
        engine.load_state(tmp_path)
