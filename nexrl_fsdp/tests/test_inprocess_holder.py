"""EngineHolder: the service-holder contract, batched sampling, every loss option, the
KL reference, sampling staleness and checkpoints, on the shipped tiny model."""

from __future__ import annotations

import math
import pickle
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from nexrl_core.chat_model import SamplingOptions
from nexrl_core.config.adamw import AdamWSettings
from nexrl_core.config.schema import DType, ModelConfig
from nexrl_core.holders import TrainStepConfig
from nexrl_core.registry import find_spec
from nexrl_core.testing import ServiceHolderContract
from nexrl_core.types import RemoteDatum
from nexrl_fsdp import Engine
from nexrl_fsdp.inprocess.config import EngineHolderConfig
from nexrl_fsdp.inprocess.holder import EngineHolder

MESSAGES = [{"role": "user", "content": "12+7="}]
FROZEN = AdamWSettings(learning_rate=0.0, weight_decay=0.0, grad_clip_norm=0.0)
"""Computes gradients without moving the weights, so two steps see the same model."""
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
    holder = make_holder(tmp_path_factory.mktemp("lora"), lora_rank=4)
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


def rl_datum(holder: EngineHolder, response: Sequence[int], deltas: Sequence[float], advantages: Sequence[float]) -> RemoteDatum:
    """A datum whose sampler logprobs sit ``deltas`` below the current model's, so each
    response token's importance ratio is ``exp(delta)``."""
    prompt = prompt_of(holder)
    tokens = prompt + list(response)
    (current,) = holder.engine.compute_logprobs([tokens])
    pad = [0.0] * (len(prompt) - 1)
    return RemoteDatum(
        input_tokens=tokens[:-1],
        target_tokens=tokens[1:],
        sampling_logprobs=pad + [float(current[len(prompt) + i]) - delta for i, delta in enumerate(deltas)],
        advantages=pad + list(advantages),
        loss_mask=pad + [1.0] * len(response),
    )


def probe_datums(holder: EngineHolder) -> list[RemoteDatum]:
    """Two datums that make every option of every loss matter: ratios on both sides of
    every clip range, a negative advantage on a huge ratio (dual clip), and sequence
    ratios above and below 1 (GSPO)."""
    response = [int(token) for token in holder.engine.tokenizer.encode("19 is it", add_special_tokens=False)][:4]
    response += response[:1] * (8 - len(response))
    deltas = [0.5, -0.5, 2.0, -0.1, 0.3, -2.0, 0.05, 1.0]
    advantages = [1.0, -1.0, -1.0, 1.0, -1.0, 1.0, 1.0, -1.0]
    return [
        rl_datum(holder, response, deltas, advantages),
        rl_datum(holder, response, [-delta for delta in deltas], advantages),
    ]


OPTION_CASES: list[tuple[str, str, Any, Any, dict[str, Any]]] = [
    # (loss, option, value, other value, options held fixed so that the option applies)
    ("cross_entropy", "agg_mode", "token-sum", "token-mean", {}),
    ("cross_entropy", "norm_constant", 1.0, 4.0, {"agg_mode": "seq-mean-token-sum-norm"}),
    ("importance_sampling", "agg_mode", "token-sum", "seq-mean-token-mean", {}),
    ("importance_sampling", "norm_constant", 1.0, 4.0, {"agg_mode": "seq-mean-token-sum-norm"}),
    ("importance_sampling", "entropy_coeff", 0.0, 0.5, {}),
    ("ppo", "clip_low", 0.2, 0.6, {}),
    ("ppo", "clip_high", 0.2, 1.0, {}),
    ("ppo", "dual_clip_c", 3.0, 10.0, {}),
    ("ppo", "agg_mode", "token-sum", "token-mean", {}),
    ("ppo", "norm_constant", 1.0, 4.0, {"agg_mode": "seq-mean-token-sum-norm"}),
    ("ppo", "entropy_coeff", 0.0, 0.5, {}),
    ("cispo", "clip_low", 0.2, 0.6, {}),
    ("cispo", "clip_high", 0.2, 1.0, {}),
    ("cispo", "agg_mode", "token-sum", "token-mean", {}),
    ("cispo", "norm_constant", 1.0, 4.0, {"agg_mode": "seq-mean-token-sum-norm"}),
    ("cispo", "entropy_coeff", 0.0, 0.5, {}),
    ("gspo", "clip_low", 3e-4, 0.5, {}),
    ("gspo", "clip_high", 4e-4, 1.0, {}),
    ("gspo", "agg_mode", "token-sum", "seq-mean-token-mean", {}),
    ("gspo", "norm_constant", 1.0, 4.0, {"agg_mode": "seq-mean-token-sum-norm"}),
    ("gspo", "entropy_coeff", 0.0, 0.5, {}),
]


def grad_norm(holder: EngineHolder, datums: list[RemoteDatum], loss: str, options: dict[str, Any]) -> float:
    metrics = holder.train(datums, TrainStepConfig(loss_fn=loss, loss_fn_config=options, optimizer=FROZEN))
    assert metrics["lr"] == 0.0
    return metrics["grad_norm"]


def test_every_option_of_every_loss_has_a_case() -> None:
    for loss in {case[0] for case in OPTION_CASES}:
        options = {field.name for field in attrs.fields(find_spec("policy_losses", loss).config_class)}
        assert {case[1] for case in OPTION_CASES if case[0] == loss} == options, loss


@pytest.mark.parametrize(("loss", "option", "value", "other", "fixed"), OPTION_CASES, ids=[f"{c[0]}-{c[1]}" for c in OPTION_CASES])
def test_each_loss_option_changes_the_gradient(
    shared_holder: EngineHolder, loss: str, option: str, value: Any, other: Any, fixed: dict[str, Any]
) -> None:
    datums = probe_datums(shared_holder)
    first = grad_norm(shared_holder, datums, loss, {**fixed, option: value})
    again = grad_norm(shared_holder, datums, loss, {**fixed, option: value})
    changed = grad_norm(shared_holder, datums, loss, {**fixed, option: other})
    assert again == first, "the same step must give the same gradient"
    assert math.isfinite(changed) and not math.isclose(changed, first, rel_tol=1e-4), (
        f"{loss}.{option}: {value!r} -> {other!r} left the gradient norm at {first}"
    )


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


@pytest.mark.parametrize("loss", sorted({case[0] for case in OPTION_CASES}))
def test_every_registered_loss_is_honoured(shared_holder: EngineHolder, loss: str) -> None:
    options = {case[1]: case[2] for case in OPTION_CASES if case[0] == loss}
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

    assert sorted(sorted(rows) for rows in calls) == [[1], [1, 4, 4]], (
        "one call per sampling setting; a group of consecutive seeds is one prompt row"
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
