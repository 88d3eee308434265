"""The local Weaver service on worker groups (``--workers 2``: each model on 2 gloo ranks
under torchrun) trains exactly as on its in-process engine (``--workers 0``).

The unmodified nex-weaver SDK drives both services the same way (cross-entropy, PPO,
a custom loss, every AdamW field); every step's loss, the optimizer's numbers and the
downloaded export agree within 1e-4 (fp32). One service of each kind serves the module.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import weaver
from safetensors.torch import load_file
from weaver.types import AdamParams, Datum, ModelInput

from nexrl_engine.loading import resolve_model_dir
from nexrl_remote_api.testing import WorkerGroupLossContract
from nexrl_weaver.testing import BASE_MODEL, sdk_client, start_service

pytestmark = pytest.mark.slow

WORKERS = (0, 2)
"""In-process engine, and a worker group of two ranks per model."""
STEPS = 3
ADAM = AdamParams(learning_rate=2e-4, beta1=0.85, beta2=0.98, eps=1e-7, weight_decay=0.02, grad_clip_norm=1.0)
"""Every AdamW field away from its default (see the Tinker twin of this module for the rate)."""


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, Any]]:
    started: dict[int, Any] = {}
    try:
        for workers in WORKERS:
            started[workers] = start_service(tmp_path_factory.mktemp(f"weaver-workers-{workers}"), workers=workers)
        yield started
    finally:
        for service in started.values():
            service.stop()


@pytest.fixture(scope="module")
def clients(services: dict[int, Any]) -> Iterator[dict[int, Any]]:
    made = {}
    try:
        for workers, service in services.items():
            made[workers] = sdk_client(service.base_url)
            made[workers].connect()
        yield made
    finally:
        for client in made.values():
            client.close()


def sft_data(tokenizer: Any) -> list[Datum]:
    data = []
    for question, answer in (("12+34=", "46"), ("7+8=", "15"), ("40+2=", "42")):
        prompt = tokenizer.encode(question, add_special_tokens=False)
        tokens = prompt + tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id or 2]
        weights = [0.0] * (len(prompt) - 1) + [1.0] * (len(tokens) - len(prompt))
        data.append(Datum(model_input=ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights}))
    return data


def rl_data(data: list[Datum], logprobs: list[list[float]]) -> list[Datum]:
    """Off-policy RL datums: the sampler's logprobs a little off the current ones."""
    out = []
    for index, (datum, current) in enumerate(zip(data, logprobs)):
        weights = list(datum.loss_fn_inputs["weights"])
        out.append(
            Datum(
                model_input=datum.model_input,
                loss_fn_inputs={
                    "target_tokens": list(datum.loss_fn_inputs["target_tokens"]),
                    "logprobs": [lp - 0.1 * (position % 3 - 1) * w for position, (lp, w) in enumerate(zip(current, weights))],
                    "advantages": [(1.0 if index % 2 == 0 else -0.5) * w for w in weights],
                },
            )
        )
    return out


def _logprobs(result: dict[str, Any]) -> list[list[float]]:
    return [output["logprobs"]["data"] for output in result["loss_fn_outputs"]]


def custom_loss(data: Any, logprobs: Any) -> tuple[Any, dict[str, float]]:
    return -sum(lp.sum() for lp in logprobs), {}


def train(client: Any, lora_rank: int = 0) -> dict[str, Any]:
    """STEPS steps of SFT, PPO and a custom loss through the SDK on a model with LoRA
    ``lora_rank`` (0: every weight trains); every number each step reports, and the
    model's export."""
    if lora_rank:
        model = client.create_model(base_model=BASE_MODEL, training_mode="lora", lora_config={"rank": lora_rank, "seed": 3})
    else:
        model = client.create_model(base_model=BASE_MODEL, training_mode="full_ft")
    data = sft_data(model.get_tokenizer())
    steps = []
    for _ in range(STEPS):
        current = model.forward(data, "forward_logprob")
        sft = model.forward_backward(data, "cross_entropy")
        ppo = model.forward_backward(
            rl_data(data, _logprobs(current)), "ppo", loss_fn_config={"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
        )
        custom = model.forward_backward_custom(data[:1], custom_loss)
        optim = model.optim_step(ADAM)
        steps.append(
            {
                "sft loss": sft["metrics"]["loss:sum"],
                "ppo loss": ppo["metrics"]["loss:sum"],
                "custom loss": float(custom["loss"]),
                "logprobs": _logprobs(current),
                "optim": {key: value for key, value in optim["metrics"].items() if isinstance(value, float)},
            }
        )
    return {"model": model, "steps": steps, "export": model.export_weights()}


@pytest.fixture(scope="module")
def runs(clients: dict[int, Any]) -> dict[int, dict[str, Any]]:
    return {workers: train(client) for workers, client in clients.items()}


@pytest.fixture(scope="module")
def lora_runs(clients: dict[int, Any]) -> dict[int, dict[str, Any]]:
    return {workers: train(client, lora_rank=4) for workers, client in clients.items()}


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_every_step_equals_the_in_process_engine(kind: str, request: pytest.FixtureRequest) -> None:
    runs = request.getfixturevalue("runs" if kind == "full" else "lora_runs")
    engine, groups = runs[0]["steps"], runs[2]["steps"]
    for step, (one, two) in enumerate(zip(engine, groups)):
        for key in ("sft loss", "ppo loss", "custom loss"):
            assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-5), f"step {step}: {key}"
        for a, b in zip(one["logprobs"], two["logprobs"]):
            np.testing.assert_allclose(b, a, atol=1e-4)
        assert two["optim"] == pytest.approx(one["optim"], rel=1e-4), f"step {step}: optimizer"
    assert engine[-1]["sft loss"] < engine[0]["sft loss"]  # the steps did train


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_the_downloaded_export_equals_the_in_process_engine(kind: str, clients, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """The full model's export (``hf_model``), and a LoRA model's (its ``hf_adapter``)."""
    runs = request.getfixturevalue("runs" if kind == "full" else "lora_runs")
    file = "model.safetensors" if kind == "full" else "adapter_model.safetensors"
    weights = {
        workers: load_file(str(clients[workers].download_weights(runs[workers]["export"], tmp_path / str(workers)) / file))
        for workers in WORKERS
    }
    assert set(weights[0]) == set(weights[2])
    assert max(float((weights[0][name] - weights[2][name]).abs().max()) for name in weights[0]) < 1e-4
    if kind == "full":
        base = load_file(str(resolve_model_dir(BASE_MODEL) / "model.safetensors"))
        assert max(float((base[name] - weights[2][name]).abs().max()) for name in base) > 1e-4  # it did train
    else:
        assert any("lora_B" in name and float(weights[2][name].abs().max()) > 0 for name in weights[2])  # it did train


class TestEveryLossOnAGroup(WorkerGroupLossContract):
    """Through the Weaver holder, on this module's two services."""


def test_terminating_a_model_stops_its_group(services, clients) -> None:
    model = clients[2].create_model(base_model=BASE_MODEL, training_mode="full_ft")
    data = sft_data(model.get_tokenizer())
    model.forward(data, "forward_logprob")  # the group runs
    pids = services[2].state.engines.training(model.model_id).rank_pids()
    clients[2].terminate_model(model.model_id)
    deadline = time.monotonic() + 60
    while any(_alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids.values()), f"ranks {pids} outlived their terminated model"
    with pytest.raises(weaver.WeaverAPIError, match=r"\[410\].*terminated"):
        model.forward(data, "forward_logprob")


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
