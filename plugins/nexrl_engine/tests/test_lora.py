"""LoRA: what trains, the target flags, seeding, checkpoints and merged export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nexrl_engine import Datum, Engine

DATA = [
    Datum(
        input_tokens=[1, 40, 50, 60, 70],
        loss_fn_inputs={"target_tokens": [40, 50, 60, 70, 2], "logprobs": [-5.0] * 5, "advantages": [0, 1, 1, 1, 1]},
    )
]
PROBE = torch.tensor([[1, 40, 50, 60, 70, 80]])


def _state(engine: Engine) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in engine.model.state_dict().items()}


def _step(engine: Engine, steps: int = 1) -> None:
    for _ in range(steps):
        engine.forward_backward(DATA, "importance_sampling")
        engine.optim_step(learning_rate=1e-2)


def _logits(engine: Engine) -> torch.Tensor:
    with torch.no_grad():
        return engine.model(input_ids=PROBE).logits


def test_only_adapters_change(shared_engine: Engine) -> None:
    engine = Engine(model="nexrl-tiny", lora={"rank": 4}, seed=1)
    names = engine.trainable_parameter_names()
    assert names and all("lora_" in name for name in names)
    assert engine.num_parameters(trainable_only=True) < 0.1 * engine.num_parameters()
    # B starts at zero, so the adapted model starts equal to the base model.
    assert torch.equal(_logits(engine), _logits(shared_engine))
    before = _state(engine)
    _step(engine)
    after = _state(engine)
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed and all("lora_" in name for name in changed)
    assert not torch.equal(_logits(engine), _logits(shared_engine))


@pytest.mark.parametrize(
    ("flags", "present", "absent"),
    [
        ({"train_unembed": True}, ["lm_head", "q_proj", "gate_proj"], []),
        ({"train_unembed": False}, ["q_proj", "gate_proj"], ["lm_head"]),
        ({"train_mlp": False, "train_unembed": False}, ["q_proj", "o_proj"], ["gate_proj", "down_proj", "lm_head"]),
        ({"train_attn": False, "train_unembed": False}, ["up_proj"], ["q_proj", "lm_head"]),
    ],
)
def test_target_flags(flags: dict, present: list[str], absent: list[str]) -> None:
    names = Engine(model="nexrl-tiny", lora={"rank": 2, **flags}).trainable_parameter_names()
    modules = {part for name in names for part in f".{name}".split(".")}
    for module in present:
        assert module in modules, module
    for module in absent:
        assert module not in modules, module


def test_seeded_initialisation() -> None:
    a = Engine(model="nexrl-tiny", lora={"rank": 4}, seed=3)
    b = Engine(model="nexrl-tiny", lora={"rank": 4}, seed=3)
    c = Engine(model="nexrl-tiny", lora={"rank": 4}, seed=4)
    name = a.trainable_parameter_names()[0]
    assert torch.equal(_state(a)[name], _state(b)[name])
    assert not torch.equal(_state(a)[name], _state(c)[name])


def test_lora_save_load_round_trip(tmp_path: Path) -> None:
    engine = Engine(model="nexrl-tiny", lora={"rank": 4}, seed=1)
    _step(engine, 2)
    engine.save_state(tmp_path / "ckpt")
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "ckpt" / "weights.safetensors"))
    assert set(saved) == set(engine.trainable_parameter_names())
    _step(engine, 1)
    expected = _state(engine)

    resumed = Engine(model="nexrl-tiny", lora={"rank": 4}, seed=99)  # different init, overwritten by load
    resumed.load_state(tmp_path / "ckpt")
    _step(resumed, 1)
    got = _state(resumed)
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    with pytest.raises(ValueError, match="LoRA settings"):
        Engine(model="nexrl-tiny", lora={"rank": 8}).load_state(tmp_path / "ckpt")


@pytest.mark.parametrize("train_unembed", [True, False])
def test_merged_export_matches(tmp_path: Path, train_unembed: bool) -> None:
    engine = Engine(model="nexrl-tiny", seed=1, lora={"rank": 4, "train_unembed": train_unembed})
    _step(engine, 3)
    exported = Engine(model=str(engine.export_hf(tmp_path / "merged")))
    assert not exported.is_lora
    torch.testing.assert_close(_logits(exported), _logits(engine), rtol=0, atol=1e-4)
    in_memory = engine.export_sampler(tmp_path / "merged-again")
    assert not in_memory.is_lora
    assert torch.equal(_logits(in_memory), _logits(Engine(model=str(tmp_path / "merged-again"))))
    # The training engine keeps its adapters (export works on a copy).
    assert engine.trainable_parameter_names() and all("lora_" in n for n in engine.trainable_parameter_names())
    _step(engine, 1)


def test_export_keeps_the_adapter_in_peft_layout(tmp_path: Path) -> None:
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    engine = Engine(model="nexrl-tiny", seed=1, lora={"rank": 4})
    _step(engine, 3)
    adapter = engine.export_hf(tmp_path / "export") / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["target_modules"] == sorted(config["target_modules"])  # same weights, same files
    base = AutoModelForCausalLM.from_pretrained(str(engine.model_dir))
    with torch.no_grad():
        logits = PeftModel.from_pretrained(base, str(adapter)).eval()(PROBE).logits
    torch.testing.assert_close(logits, _logits(engine), rtol=0, atol=1e-4)
    full = Engine(model="nexrl-tiny")
    assert not (full.export_hf(tmp_path / "no-adapter") / "adapter").exists()


def test_lora_in_bf16_trains_and_samples() -> None:
    engine = Engine(model="nexrl-tiny", dtype="bfloat16", lora={"rank": 4}, seed=1)
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters() if p.requires_grad}
    result = engine.forward_backward(DATA, "ppo")
    assert torch.isfinite(torch.tensor(result.metrics["loss:sum"]))
    step = engine.optim_step(learning_rate=1e-2)
    assert not step.skipped
    after = dict(engine.model.named_parameters())
    assert any(not torch.equal(before[n], after[n]) for n in before)
    sample = engine.sample([[1, 40, 50]], {"max_tokens": 3, "seed": 0})
    assert len(sample[0].sequences[0].tokens) <= 3
