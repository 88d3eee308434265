"""Loading by shipped name and from a directory, dtypes, and clear errors for bad input."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from nexrl_engine import Engine, EngineConfig, SamplingParams, resolve_model_dir
from nexrl_engine.loading import shipped_model_dir


def test_load_by_name(shared_engine: Engine) -> None:
    assert shared_engine.base_model_id == "nexrl-tiny"
    assert shared_engine.vocab_size == 1024
    assert shared_engine.tokenizer.eos_token == "<|im_end|>"
    assert shared_engine.tokenizer.convert_tokens_to_ids("<|im_end|>") in shared_engine.eos_token_ids
    assert shared_engine.pad_token_id == shared_engine.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert 2_000_000 < shared_engine.num_parameters() < 3_000_000
    assert not shared_engine.is_lora
    assert shared_engine.step == 0


def test_load_from_directory(shared_engine: Engine) -> None:
    directory = shipped_model_dir("nexrl-tiny")
    engine = Engine(EngineConfig(model=str(directory)))
    assert engine.base_model_id == str(directory.resolve())
    ids = torch.tensor([[1, 40, 50, 60]])
    with torch.no_grad():
        assert torch.equal(engine.model(input_ids=ids).logits, shared_engine.model(input_ids=ids).logits)


def test_bf16_loads_and_samples(chat_prompts: list[list[int]]) -> None:
    engine = Engine(model="nexrl-tiny", dtype="bf16")
    assert engine.config.dtype == "bfloat16"
    assert next(engine.model.parameters()).dtype == torch.bfloat16
    result = engine.sample(chat_prompts[:2], SamplingParams(max_tokens=4, seed=0))
    for sample in result:
        assert all(math.isfinite(lp) and lp <= 0 for lp in sample.sequences[0].logprobs)


def test_unknown_model_name() -> None:
    with pytest.raises(ValueError, match=r"unknown model 'no-such-model'.*nexrl-tiny"):
        Engine(model="no-such-model")


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model_dir(tmp_path)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"dtype": "float8"}, "dtype must be one of"),
        ({"lora": {"rank": -1}}, "rank must be an integer >= 0"),
        ({"lora": {"rank": 4, "train_mlp": False, "train_attn": False, "train_unembed": False}}, "at least one of"),
        ({"model": ""}, "model must be a non-empty string"),
    ],
)
def test_bad_config(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**fields)
