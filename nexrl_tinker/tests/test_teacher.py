"""The recipe's teacher on the ``remote_api`` backend over NexRL's Tinker service: the service
serves it beside the trained model for sampling and scoring only (``--sampling-model``), and
the Tinker holder scores the student's tokens under it with the SDK's ``compute_logprobs``,
as tinker-cookbook's on-policy distillation does against hosted Tinker."""

from __future__ import annotations

import json
from collections.abc import Iterator
from importlib.resources import as_file, files
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from nexrl_core.config import ModelConfig, load_config
from nexrl_core.run.loop import run_training
from nexrl_engine.engine import Engine
from nexrl_tinker.holder import TinkerServiceHolder
from nexrl_tinker.holder_config import TinkerHolderConfig
from nexrl_tinker.testing import BASE_MODEL, TEST_API_KEY, start_service

SEQUENCES = [[9, 21, 33, 47, 5, 61], [12, 8, 8, 30, 2]]
COEF = 0.5


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped model with every weight moved by seeded noise: a local Hugging Face
    directory with the student's tokenizer whose log-probs are its own."""
    engine = Engine(model=BASE_MODEL, seed=0)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in engine.model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * 0.05)
    return engine.export_hf(tmp_path_factory.mktemp("teacher") / "model")


@pytest.fixture(scope="module")
def teacher_service(tmp_path_factory: pytest.TempPathFactory, teacher_dir: Path) -> Iterator[Any]:
    service = start_service(tmp_path_factory.mktemp("teacher-service"), api_key=TEST_API_KEY, sampling_models=(str(teacher_dir),))
    try:
        yield service
    finally:
        service.stop()


def independent_logprobs(model_dir: Path, sequences: list[list[int]]) -> list[list[float]]:
    """``log p(token[i] | tokens[:i])`` of each sequence under ``model_dir``'s weights, by
    plain transformers (position 0 has none)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    scored = []
    with torch.no_grad():
        for tokens in sequences:
            logits = model(torch.tensor([tokens])).logits[0, :-1].float()
            scored.append(torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0].tolist())
    return scored


def test_the_holder_scores_under_the_teacher_the_service_serves_beside_the_model(teacher_service: Any, teacher_dir: Path) -> None:
    config = TinkerHolderConfig(
        model=ModelConfig(name=BASE_MODEL), base_url=teacher_service.base_url, api_key=TEST_API_KEY, teacher=str(teacher_dir)
    )
    holder = TinkerServiceHolder(config)
    try:
        scored = holder.teacher_logprobs(SEQUENCES)
        reference = holder.reference_logprobs(SEQUENCES)
    finally:
        holder.close()
    for row, want in zip(scored, independent_logprobs(teacher_dir, SEQUENCES), strict=True):
        assert row[0] == 0.0
        torch.testing.assert_close(torch.tensor(row[1:]), torch.tensor(want), rtol=0, atol=1e-4)
    assert all(abs(a - b) > 1e-3 for row, base in zip(scored, reference) for a, b in zip(row[1:], base[1:])), (
        "the teacher's scores are its own, not the student's base model's"
    )


def test_the_teacher_is_listed_as_sampleable_and_cannot_be_trained(teacher_service: Any, teacher_dir: Path) -> None:
    import tinker

    headers = {"X-API-Key": TEST_API_KEY}
    models = httpx.get(f"{teacher_service.base_url}/api/v1/get_server_capabilities", headers=headers).json()["supported_models"]
    assert [(model["trainable"], model["sampleable"]) for model in models] == [(True, True), (False, True)]
    assert models[1]["model_name"] == str(teacher_dir)
    client = tinker.ServiceClient(base_url=teacher_service.base_url, api_key=TEST_API_KEY)
    try:
        with pytest.raises(Exception, match="served for sampling and scoring only"):
            client.create_lora_training_client(str(teacher_dir), rank=4).result(timeout=60)
    finally:
        client.close("success").result(timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1], ids=["engine", "worker group"])
def test_a_distillation_step_on_the_embedded_service_trains_on_the_teachers_scores(
    tmp_path: Path, teacher_dir: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    """Each datum's advantage on a trained token is ``-COEF * (sampler logprob - teacher
    logprob)`` of that token, the teacher scored by the run's own embedded service, whether
    the student trains in the service's process or on a worker group of its own
    (``backend.options.workers``): the teacher, never trained, is served by the service's
    sampler beside the student's sampling sessions, wherever the student's group is placed."""
    received: list[Any] = []
    train = TinkerServiceHolder.train
    monkeypatch.setattr(TinkerServiceHolder, "train", lambda self, datums, config: received.extend(datums) or train(self, datums, config))
    with as_file(files("nexrl_core").joinpath("recipes", "quickstart.yaml")) as path:
        config = load_config(
            path,
            [
                f"output.dir={tmp_path / 'run'}", f"teacher.model={teacher_dir}", "algorithm.advantage.name=on_policy_distillation",
                f"algorithm.advantage.options.kl_coef={COEF}", "schedule.steps=1", "schedule.validate_every=0",
                "rollout.prompts_per_step=2", "rollout.group_size=2", "output.sinks=[]", f"backend.options.workers={workers}",
            ],
        )  # fmt: skip
    run_training(config, progress_bar=False)
    (row,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert row["teacher/reverse_kl"] > 0 and row["train/grad_norm"] > 0
    groups = list((tmp_path / "run" / "backend" / "service" / "workers").glob("*.log"))
    assert len(groups) == workers, "the student trained on a worker group exactly when asked to"
    assert len(received) == 4
    for datum in received:
        sequence = list(datum.input_tokens) + [datum.target_tokens[-1]]
        (scores,) = independent_logprobs(teacher_dir, [sequence])
        for advantage, sampled, scored, trained in zip(datum.advantages, datum.sampling_logprobs, scores, datum.loss_mask, strict=True):
            assert advantage == pytest.approx(-COEF * (sampled - scored) if trained else 0.0, abs=1e-4)
