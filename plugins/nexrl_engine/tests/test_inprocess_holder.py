"""EngineHolder: the service-holder contract, batched sampling, every loss option, the
KL reference, sampling staleness and checkpoints, on the shipped tiny model."""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from importlib.resources import as_file, files
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from nexrl_core.chat.model import SamplingOptions
from nexrl_core.config import load_config
from nexrl_core.config.adamw import AdamWSettings
from nexrl_core.config.lora import LoraSettings
from nexrl_core.config.schema import DType, ModelConfig
from nexrl_core.testing import ServiceHolderContract, TrainerContract
from nexrl_core.testing.loss_option_contract import LossOptionCase, LossOptionContract, probe_datums
from nexrl_core.training.holders import TrainStepConfig
from nexrl_core.training.trainer import Trainer, build_trainer
from nexrl_engine import Engine
from nexrl_engine.inprocess.config import EngineHolderConfig
from nexrl_engine.inprocess.holder import EngineHolder
from nexrl_grpo.option_cases import LOSS_OPTION_CASES

MESSAGES = [{"role": "user", "content": "12+7="}]
MOVING = AdamWSettings(learning_rate=1e-2, weight_decay=0.0)


def make_holder(directory: Path, **model: Any) -> EngineHolder:
    return EngineHolder(EngineHolderConfig(model=ModelConfig(name="nexrl-tiny", **model)), directory)


@pytest.fixture(scope="module")
def shared_holder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineHolder]:
    holder = make_holder(tmp_path_factory.mktemp("engine"))
    try:
        yield holder
    finally:
        holder.close()


@pytest.fixture(scope="module")
def lora_holder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineHolder]:
    holder = make_holder(tmp_path_factory.mktemp("lora"), lora=LoraSettings(rank=4))
    try:
        yield holder
    finally:
        holder.close()


class TestEngineHolderContract(ServiceHolderContract):
    @pytest.fixture
    def holder(self, shared_holder: EngineHolder) -> EngineHolder:
        return shared_holder

    def test_pickled_holder_reconnects(self, holder: EngineHolder) -> None:
        """The model lives in this process: pickling is refused, with the reason."""
        with pytest.raises(TypeError, match="holds its model in this process"):
            pickle.dumps(holder)


def prompt_of(holder: EngineHolder, content: str = "12+7=") -> list[int]:
    prompt = holder.apply_chat_template([{"role": "user", "content": content}], tokenize=True)
    assert isinstance(prompt, list)
    return prompt


@pytest.fixture(scope="module")
def base_holder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineHolder]:
    """A holder nothing trains, so its weights stay the base ones the probe is set against."""
    holder = make_holder(tmp_path_factory.mktemp("base"))
    try:
        yield holder
    finally:
        holder.close()


class TestGrpoTrainerContract(TrainerContract):
    """The registered GRPO trainer as the quickstart builds it, with an adaptive KL
    coefficient so that its state is more than empty."""

    @pytest.fixture
    def new_trainer(self) -> Callable[[], Trainer]:
        with as_file(files("nexrl_core").joinpath("recipes", "quickstart.yaml")) as path:
            recipe = load_config(path, ["algorithm.kl.coef=0.1", "algorithm.kl.controller=adaptive", "algorithm.kl.horizon=10"])
        return lambda: build_trainer(recipe, "remote_api_grpo", "backend.options.trainer")

    @pytest.fixture
    def holder(self, shared_holder: EngineHolder) -> EngineHolder:
        return shared_holder


class TestEngineHolderLossOptions(LossOptionContract):
    @pytest.fixture
    def holder(self, base_holder: EngineHolder) -> EngineHolder:
        return base_holder

    @pytest.fixture
    def option_cases(self) -> Sequence[LossOptionCase]:
        return LOSS_OPTION_CASES


def test_every_adamw_field_reaches_the_optimizer(shared_holder: EngineHolder, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = AdamWSettings(learning_rate=0.0, beta1=0.8, beta2=0.9, eps=1e-7, weight_decay=0.05, grad_clip_norm=1e-3)
    received: list[Any] = []
    optim_step = shared_holder.engine.optim_step

    def recording(adam: Any) -> Any:
        received.append(adam)
        return optim_step(adam)

    monkeypatch.setattr(shared_holder.engine, "optim_step", recording)
    metrics = shared_holder.train(probe_datums(shared_holder), TrainStepConfig(loss_fn="ppo", optimizer=settings))
    assert [attrs.asdict(adam) for adam in received] == [settings.to_json()]
    assert metrics["clipped"] == 1.0 and metrics["lr"] == 0.0


@pytest.mark.parametrize("loss", sorted({case.loss for case in LOSS_OPTION_CASES}))
def test_every_registered_loss_is_honoured(shared_holder: EngineHolder, loss: str) -> None:
    options: dict = {}
    for case in LOSS_OPTION_CASES:  # in table order: norm_constant after agg_mode sets the aggregation it needs
        if case.loss == loss:
            options.update({**case.fixed, case.option: case.value})
    assert shared_holder.refused_options(TrainStepConfig(loss_fn=loss, loss_fn_config=options)) == {}


def test_unknown_loss_option_is_refused(shared_holder: EngineHolder) -> None:
    refused = shared_holder.refused_options(TrainStepConfig(loss_fn="ppo", loss_fn_config={"kl_beta": 0.1}))
    assert list(refused) == ["loss_fn"] and "kl_beta" in refused["loss_fn"]


def test_concurrent_requests_are_one_engine_call_with_the_samples_of_each_alone(
    shared_holder: EngineHolder, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = [prompt_of(shared_holder, "12+7="), prompt_of(shared_holder, "3+45=")]
    # A group of four consecutive seeds per prompt, plus a stray seed and a greedy request.
    asks = [(prompt, SamplingOptions(max_tokens=6, seed=100 + run)) for prompt in prompts for run in range(4)]
    asks += [(prompts[0], SamplingOptions(max_tokens=6, seed=7)), (prompts[1], SamplingOptions(max_tokens=6, temperature=0.0))]
    alone = [shared_holder.sample_from_prompt(prompt, options) for prompt, options in asks]

    calls: list[list[int]] = []
    sample = shared_holder.sampler.sample

    def counting(prompts: Any, params: Any, **kwargs: Any) -> Any:
        calls.append(list(kwargs["num_samples"]))
        return sample(prompts, params, **kwargs)

    monkeypatch.setattr(shared_holder.sampler, "sample", counting)
    gate, entered = threading.Event(), threading.Event()
    blocker = threading.Thread(target=shared_holder.compute.call, args=(lambda: (entered.set(), gate.wait()),))
    blocker.start()
    assert entered.wait(timeout=10)
    together: list[Any] = [None] * len(asks)

    def run(index: int) -> None:
        together[index] = shared_holder.sample_from_prompt(*asks[index])

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(asks))]
    for thread in threads:
        thread.start()
    while shared_holder.compute.queued < len(asks):
        time.sleep(0.001)
    gate.set()
    for thread in [blocker, *threads]:
        thread.join(timeout=60)

    assert [sorted(rows) for rows in calls] == [[1, 1, 4, 4]], (
        "one call whatever each request samples with; a group of consecutive seeds is one prompt row"
    )
    for merged, single in zip(together, alone):
        assert merged.response_tokens == single.response_tokens
        assert merged.response_logprobs == pytest.approx(single.response_logprobs, abs=1e-4)
    assert len({tuple(result.response_tokens) for result in together}) > 2, "runs must sample differently"


def test_sampling_keeps_its_weights_until_they_are_published(tmp_path: Path) -> None:
    holder = make_holder(tmp_path)
    try:
        prompt = prompt_of(holder)
        options = SamplingOptions(max_tokens=6, seed=3)
        before = holder.sample_from_prompt(prompt, options)
        holder.train(probe_datums(holder), TrainStepConfig(optimizer=MOVING))
        stale = holder.sample_from_prompt(prompt, options)
        assert stale.response_logprobs == before.response_logprobs, "training must not reach sampling before a publish"
        holder.update_sampling_weights()
        fresh = holder.sample_from_prompt(prompt, options)
        assert fresh.response_logprobs != before.response_logprobs
    finally:
        holder.close()


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_reference_logprobs_stay_at_the_base_model_after_training(
    kind: str, shared_holder: EngineHolder, lora_holder: EngineHolder, shared_engine: Engine
) -> None:
    holder = shared_holder if kind == "full" else lora_holder
    datums = probe_datums(holder)
    sequence = datums[0].input_tokens + datums[0].target_tokens[-1:]
    for _ in range(2):
        holder.train(datums, TrainStepConfig(optimizer=MOVING))
    (trained,) = holder.engine.compute_logprobs([sequence])
    reference = holder.reference_logprobs([sequence])[0]
    (base,) = shared_engine.compute_logprobs([sequence])
    assert reference == pytest.approx([0.0] + base[1:], abs=1e-5)
    assert trained[1:] != pytest.approx(reference[1:], abs=1e-3), "training must have moved the weights"
    assert holder.engine.compute_logprobs([sequence])[0] == trained, "the adapters are back on after the reference"


def test_checkpoint_round_trip_restores_weights_and_optimizer(tmp_path: Path) -> None:
    holder = make_holder(tmp_path / "engine")
    try:
        datums = probe_datums(holder)
        sequence = datums[0].input_tokens
        holder.train(datums, TrainStepConfig(optimizer=MOVING))
        path = holder.save_checkpoint("step_000001")
        (saved,) = holder.engine.compute_logprobs([sequence])
        saved_step = holder.engine.step
        holder.train(datums, TrainStepConfig(optimizer=MOVING))
        assert holder.engine.compute_logprobs([sequence])[0] != saved
        holder.load_checkpoint(path)
        assert holder.engine.compute_logprobs([sequence])[0] == saved
        assert holder.engine.step == saved_step == 1
        assert holder.update_sampling_weights(path) == path
        assert holder.sampler.compute_logprobs([sequence])[0] == saved
        with pytest.raises(ValueError, match="plain file name"):
            holder.save_checkpoint("../outside")
    finally:
        holder.close()


def test_bf16_reaches_every_engine(tmp_path: Path) -> None:
    holder = make_holder(tmp_path, dtype=DType.BF16)
    try:
        for engine in (holder.engine, holder.sampler):
            assert {parameter.dtype for parameter in engine.model.parameters()} == {torch.bfloat16}
        result = holder.sample_from_messages(MESSAGES, SamplingOptions(max_tokens=4, seed=1))
        assert result.response_tokens
    finally:
        holder.close()


def test_close_stops_the_compute_thread(tmp_path: Path) -> None:
    holder = make_holder(tmp_path)
    assert holder.compute.running
    holder.close()
    assert not holder.compute.running
    with pytest.raises(RuntimeError, match="closed"):
        holder.sample_from_messages(MESSAGES, SamplingOptions(max_tokens=2, seed=1))
