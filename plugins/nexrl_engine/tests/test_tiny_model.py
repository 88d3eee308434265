"""The shipped tiny model: reproducible build, manifest, and the addition task."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from nexrl_engine.loading import shipped_model_dir
from nexrl_engine.tiny import addition
from nexrl_engine.tiny.build import MANIFEST_NAME, BuildSettings, build, sha256_of


def test_shipped_model_matches_manifest() -> None:
    directory = shipped_model_dir("nexrl-tiny")
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    for name, digest in manifest["files_sha256"].items():
        assert sha256_of(directory / name) == digest, name
    assert sum(p.stat().st_size for p in directory.iterdir()) < 20 * 1024 * 1024
    evaluation = manifest["evaluation"]
    assert 0.1 < evaluation["sampled_reward_t1"] < 0.7
    assert 2_000_000 < manifest["parameters"] < 3_000_000


def test_build_is_deterministic(tmp_path: Path) -> None:
    settings = BuildSettings(steps=3, batch_size=16)
    first = build(tmp_path / "a", settings, eval_prompts=0, log=lambda _: None)
    second = build(tmp_path / "b", settings, eval_prompts=0, log=lambda _: None)
    assert first.model_sha256 == second.model_sha256
    assert first.tokenizer_sha256 == second.tokenizer_sha256
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    manifest = json.loads((tmp_path / "a" / MANIFEST_NAME).read_text())
    assert manifest["files_sha256"]["model.safetensors"] == first.model_sha256
    assert manifest["settings"]["steps"] == 3


def test_splits_are_disjoint_and_fixed() -> None:
    train, held = addition.train_problems(), addition.heldout_problems()
    assert len(train) == 9000 and len(held) == addition.HELDOUT_SIZE == 1000
    assert not set(train) & set(held)
    assert addition.heldout_problems(5) == held[:5]
    drawn = addition.sample_problems(random.Random(0), 200, "train")
    assert not set(drawn) & set(held)
    with pytest.raises(ValueError, match="unknown split"):
        addition.problems("test")  # type: ignore[arg-type]


def test_reward() -> None:
    problem = addition.AdditionProblem(12, 7)
    assert problem.prompt == "12+7=" and problem.answer == "19"
    assert problem.messages() == [{"role": "user", "content": "12+7="}]
    assert problem.reward("19") == 1.0
    assert problem.reward(" 19<|im_end|>") == 1.0
    assert problem.reward("20") == 0.0
    assert problem.reward("19 ") == 1.0
    assert problem.reward("019") == 0.0
    assert problem.reward("19 apples") == 0.0
    assert problem.reward("") == 0.0
