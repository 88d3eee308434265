"""The local Tinker service on worker groups (``--workers 2``: each model on 2 gloo ranks
under torchrun) trains exactly as on its in-process engine (``--workers 0``).

The unmodified tinker SDK drives both services the same way; every step's loss, the
optimizer's numbers and the exported weights agree within 1e-4 (fp32). One service of
each kind serves the whole module, and each test's models share their group's module.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tinker
import torch
from safetensors.torch import load_file
from tinker import types

from nexrl_engine.loading import resolve_model_dir
from nexrl_remote_api.testing import WorkerGroupLossContract
from nexrl_tinker.testing import BASE_MODEL, sft_data, start_service

pytestmark = pytest.mark.slow

WORKERS = (0, 2)
"""In-process engine, and a worker group of two ranks per model."""
STEPS = 3
ADAM = types.AdamParams(learning_rate=2e-4, beta1=0.85, beta2=0.98, eps=1e-7, weight_decay=0.02, grad_clip_norm=1.0)
"""Every AdamW field away from its default; the learning rate moves the weights ~6e-4 in
STEPS steps, well past the 1e-4 the two sides may differ by (a larger one amplifies
rounding through Adam's normalised update)."""


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, Any]]:
    started: dict[int, Any] = {}
    try:
        for workers in WORKERS:
            started[workers] = start_service(tmp_path_factory.mktemp(f"tinker-workers-{workers}"), workers=workers)
        yield started
    finally:
        for service in started.values():
            service.stop()


@pytest.fixture(scope="module")
def clients(services: dict[int, Any]) -> Iterator[dict[int, Any]]:
    made = {workers: tinker.ServiceClient(base_url=service.base_url) for workers, service in services.items()}
    try:
        yield made
    finally:
        for client in made.values():
            client.close("success").result(timeout=60)


def rl_data(data: list[types.Datum], logprobs: list[list[float]]) -> list[types.Datum]:
    """Off-policy RL datums: the sampler's logprobs a little off the current ones."""
    out = []
    for index, (datum, current) in enumerate(zip(data, logprobs)):
        weights = datum.loss_fn_inputs["weights"].tolist()
        out.append(
            types.Datum(
                model_input=datum.model_input,
                loss_fn_inputs={
                    "target_tokens": datum.loss_fn_inputs["target_tokens"].tolist(),
                    "logprobs": [lp - 0.1 * (position % 3 - 1) * w for position, (lp, w) in enumerate(zip(current, weights))],
                    "advantages": [(1.0 if index % 2 == 0 else -0.5) * w for w in weights],
                },
            )
        )
    return out


def train(client: Any, rank: int = 0) -> dict[str, Any]:
    """STEPS steps of SFT plus a PPO term through the SDK on a model with LoRA ``rank``
    (0: every weight trains); every number each step reports, and the model's export."""
    training = client.create_lora_training_client(base_model=BASE_MODEL, rank=rank).result(timeout=300)
    data = sft_data(training.get_tokenizer())
    steps = []
    for _ in range(STEPS):
        current = training.forward(data, "cross_entropy").result(timeout=120)
        sft = training.forward_backward(data, "cross_entropy").result(timeout=120)
        rl = rl_data(data, [o["logprobs"].tolist() for o in current.loss_fn_outputs])
        ppo = training.forward_backward(rl, "ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}).result(timeout=120)
        optim = training.optim_step(ADAM).result(timeout=120)
        steps.append(
            {
                "forward loss": current.metrics["loss:sum"],
                "sft loss": sft.metrics["loss:sum"],
                "ppo loss": ppo.metrics["loss:sum"],
                "ppo clip fraction": ppo.metrics.get("clip_frac:mean", 0.0),
                "logprobs": [o["logprobs"].tolist() for o in sft.loss_fn_outputs],
                "optim": optim.metrics,
            }
        )
    return {"training": training, "steps": steps, "export": training.save_weights_external("final").result(timeout=300).path}


@pytest.fixture(scope="module")
def runs(clients: dict[int, Any]) -> dict[int, dict[str, Any]]:
    return {workers: train(client) for workers, client in clients.items()}


LORA_RANK = 4
"""A LoRA model on every target (MLP, attention and the tied tiny model's output head)."""


@pytest.fixture(scope="module")
def lora_runs(clients: dict[int, Any]) -> dict[int, dict[str, Any]]:
    return {workers: train(client, rank=LORA_RANK) for workers, client in clients.items()}


def exported_weights(service: Any, path: str, directory: Path) -> dict[str, torch.Tensor]:
    """The export's files, downloaded through the SDK's signed URLs."""
    urls = tinker.RestClient(base_url=service.base_url).get_external_weights_urls(path).result(timeout=60).urls
    with urllib.request.urlopen(urls["model.safetensors"], timeout=60) as response:
        (directory / "model.safetensors").write_bytes(response.read())
    return load_file(str(directory / "model.safetensors"))


def test_every_step_equals_the_in_process_engine(runs: dict[int, dict[str, Any]]) -> None:
    engine, groups = runs[0]["steps"], runs[2]["steps"]
    for step, (one, two) in enumerate(zip(engine, groups)):
        for key in ("forward loss", "sft loss", "ppo loss", "ppo clip fraction"):
            assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-5), f"step {step}: {key}"
        for a, b in zip(one["logprobs"], two["logprobs"]):
            np.testing.assert_allclose(b, a, atol=1e-4)
        assert two["optim"] == pytest.approx(one["optim"], rel=1e-4), f"step {step}: optimizer"
    assert engine[-1]["sft loss"] < engine[0]["sft loss"]  # the steps did train


def test_the_exported_weights_equal_the_in_process_engine(services, runs, tmp_path: Path) -> None:
    weights = {}
    for workers in WORKERS:
        (tmp_path / str(workers)).mkdir()
        weights[workers] = exported_weights(services[workers], runs[workers]["export"], tmp_path / str(workers))
    assert set(weights[0]) == set(weights[2])
    worst = max(float((weights[0][name] - weights[2][name]).abs().max()) for name in weights[0])
    assert worst < 1e-4
    base = load_file(str(resolve_model_dir(BASE_MODEL) / "model.safetensors"))
    assert max(float((base[name] - weights[2][name]).abs().max()) for name in base) > 1e-4  # it did train


def test_the_groups_sampler_is_fed_from_the_group_not_the_disk(services, runs) -> None:
    """``save_weights_and_get_sampling_client`` on a group: the sampler has the group's
    weights (it scores like the training forward pass) even with the snapshot's files
    gone, so nothing was read back from them."""
    training = runs[2]["training"]
    sampler = training.save_weights_and_get_sampling_client().result(timeout=120)
    snapshots = list((services[2].settings.data_dir / "runs").rglob("ephemeral/*/weights.safetensors"))
    assert snapshots
    for snapshot in snapshots:
        snapshot.unlink()
    data = sft_data(training.get_tokenizer())
    full = data[0].model_input.to_ints() + [data[0].loss_fn_inputs["target_tokens"].tolist()[-1]]
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result(timeout=120)
    trained = training.forward([data[0]], "cross_entropy").result(timeout=120)
    np.testing.assert_allclose(scored[1:], trained.loss_fn_outputs[0]["logprobs"].tolist(), atol=1e-4)


class TestEveryLossOnAGroup(WorkerGroupLossContract):
    """Through the Tinker holder, on this module's two services."""


def test_a_saved_state_rebuilds_a_lost_group(services, runs) -> None:
    """A model whose group is gone comes back on its next request from its last saved
    state, on a new group, and trains on from there as the engine does."""
    outcomes = {}
    for workers in WORKERS:
        training = runs[workers]["training"]
        data = sft_data(training.get_tokenizer())
        training.save_state("before-loss").result(timeout=120)
        model_id = training.model_id
        old_pids = services[workers].state.engines.training(model_id).rank_pids() if workers else None
        services[workers].state.engines.release_training(model_id)
        outcomes[workers] = training.forward(data, "cross_entropy").result(timeout=300).metrics["loss:sum"]
        if workers:
            new_pids = services[workers].state.engines.training(model_id).rank_pids()
            assert set(new_pids.values()).isdisjoint(old_pids.values())
    assert outcomes[2] == pytest.approx(outcomes[0], rel=1e-4)


def test_a_lora_model_on_a_group_trains_and_exports_as_the_engine(services, lora_runs, tmp_path: Path) -> None:
    """LoRA on a group: every step's numbers, the merged export and the PEFT adapter
    beside it are the engine's, and the group's sampler scores as its training forward
    pass (the merged output head of the tied model arrives untied)."""
    engine, groups = lora_runs[0]["steps"], lora_runs[2]["steps"]
    for step, (one, two) in enumerate(zip(engine, groups)):
        for key in ("forward loss", "sft loss", "ppo loss"):
            assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-5), f"LoRA step {step}: {key}"
        assert two["optim"] == pytest.approx(one["optim"], rel=1e-4), f"LoRA step {step}: optimizer"
    assert engine[-1]["sft loss"] < engine[0]["sft loss"]
    files = {}
    for workers in WORKERS:
        urls = (
            tinker.RestClient(base_url=services[workers].base_url)
            .get_external_weights_urls(lora_runs[workers]["export"])
            .result(timeout=60)
            .urls
        )
        files[workers] = {}
        for name, url in urls.items():
            if name.endswith(".safetensors"):
                with urllib.request.urlopen(url, timeout=60) as response:
                    (tmp_path / f"{workers}-{name.replace('/', '_')}").write_bytes(response.read())
                files[workers][name] = load_file(str(tmp_path / f"{workers}-{name.replace('/', '_')}"))
    assert set(files[2]) == set(files[0]) and any("adapter" in name for name in files[0]), sorted(files[0])
    for name, tensors in files[0].items():
        assert set(files[2][name]) == set(tensors), name
        assert max(float((tensors[key] - files[2][name][key]).abs().max()) for key in tensors) < 1e-4, name
    training = lora_runs[2]["training"]
    sampler = training.save_weights_and_get_sampling_client().result(timeout=120)
    data = sft_data(training.get_tokenizer())
    full = data[0].model_input.to_ints() + [data[0].loss_fn_inputs["target_tokens"].tolist()[-1]]
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result(timeout=120)
    trained = training.forward([data[0]], "cross_entropy").result(timeout=120)
    np.testing.assert_allclose(scored[1:], trained.loss_fn_outputs[0]["logprobs"].tolist(), atol=1e-4)
