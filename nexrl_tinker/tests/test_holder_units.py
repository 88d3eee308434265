"""TinkerServiceHolder pieces that need no server: datums, loss options, retries, pickling."""

from __future__ import annotations

import pickle

import pytest
import tinker

from nexrl_core.config import ModelConfig
from nexrl_core.training.holders import TrainStepConfig
from nexrl_core.types import RemoteDatum
from nexrl_tinker.holder import (
    TinkerHolderConfig,
    TinkerServiceHolder,
    _hosted_loss_config,
    _to_tinker_datum,
)

TINY = ModelConfig(name="nexrl-tiny")

DATUM = RemoteDatum(
    input_tokens=[1, 2, 3],
    target_tokens=[2, 3, 4],
    sampling_logprobs=[0.0, -0.5, -0.25],
    advantages=[0.0, 1.5, 1.5],
    loss_mask=[0.0, 1.0, 1.0],
)


def test_rl_datum_carries_sampler_logprobs_and_advantages() -> None:
    datum = _to_tinker_datum(DATUM, "importance_sampling")
    assert datum.model_input.to_ints() == [1, 2, 3]
    assert set(datum.loss_fn_inputs) == {"target_tokens", "logprobs", "advantages"}
    assert datum.loss_fn_inputs["target_tokens"].data == [2, 3, 4]
    assert datum.loss_fn_inputs["advantages"].data == [0.0, 1.5, 1.5]
    assert datum.loss_fn_inputs["logprobs"].dtype == "float32"


def test_cross_entropy_datum_carries_weights() -> None:
    datum = _to_tinker_datum(DATUM, "cross_entropy")
    assert set(datum.loss_fn_inputs) == {"target_tokens", "weights"}
    assert datum.loss_fn_inputs["weights"].data == [0.0, 1.0, 1.0]


def test_unknown_loss_is_refused_with_the_valid_names() -> None:
    with pytest.raises(ValueError, match="Tinker has no loss 'no_such_loss'; use one of cross_entropy, cispo, dro, gspo"):
        _to_tinker_datum(DATUM, "no_such_loss")


def test_clip_widths_become_tinker_ratio_bounds() -> None:
    config = TrainStepConfig(loss_fn="ppo", loss_fn_config={"clip_low": 0.2, "clip_high": 0.28, "entropy_coeff": 0.0})
    assert _hosted_loss_config(config) == pytest.approx({"clip_low_threshold": 0.8, "clip_high_threshold": 1.28})
    assert _hosted_loss_config(TrainStepConfig(loss_fn="importance_sampling", loss_fn_config={"clip_low": 0.2})) == {}


def test_transient_errors_are_retried_then_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr("time.sleep", slept.append)
    config = TinkerHolderConfig(model=TINY, base_url="http://127.0.0.1:9", max_retries=2, retry_backoff_s=0.25)
    holder = TinkerServiceHolder(config)
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise tinker.APIConnectionError(request=None)  # type: ignore[arg-type]
        return "ok"

    assert holder._retry("sample", flaky) == "ok"
    assert len(calls) == 3
    assert slept == [0.25, 0.5], "retry_backoff_s doubles per attempt"

    def broken() -> str:
        raise tinker.APIConnectionError(request=None)  # type: ignore[arg-type]

    with pytest.raises(RuntimeError, match=r"failed to train after 3 attempts: APIConnectionError"):
        holder._retry("train", broken)


def test_tokenizer_path_and_renderer_name_make_the_prompt() -> None:
    """``tokenizer_path`` is read without asking the service (none listens on port 9), and
    ``renderer_name`` replaces the tokenizer's chat template with a tinker-cookbook renderer."""
    from nexrl_engine.loading import resolve_model_dir

    directory = str(resolve_model_dir("nexrl-tiny"))
    messages = [{"role": "user", "content": "1+2="}]
    prompts = [
        TinkerServiceHolder(
            TinkerHolderConfig(model=TINY, base_url="http://127.0.0.1:9", tokenizer_path=directory, renderer_name=renderer)
        ).apply_chat_template(messages)
        for renderer in (None, "role_colon")
    ]
    assert prompts == ["<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n", "User: 1+2=\n\nAssistant:"]


def test_with_renderer_name_unset_the_model_gets_the_renderer_the_cookbook_recommends(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """As v1 did, a model the cookbook knows renders with its recommended renderer (a
    stand-in model here, recommended ``role_colon``); one it does not know (the tiny model)
    renders with the tokenizer's chat template, said once in the log however many holders."""
    from tinker_cookbook import model_info

    from nexrl_engine.loading import resolve_model_dir
    from nexrl_tinker import holder as holder_module

    recommended = model_info.get_recommended_renderer_name

    def stand_in(model: str) -> str:
        return "role_colon" if model == "acme/tiny-chat" else recommended(model)

    monkeypatch.setattr(model_info, "get_recommended_renderer_name", stand_in)
    holder_module._recommended_renderer.cache_clear()
    directory = str(resolve_model_dir("nexrl-tiny"))
    messages = [{"role": "user", "content": "1+2="}]

    def prompt(model: ModelConfig) -> str:
        config = TinkerHolderConfig(model=model, base_url="http://127.0.0.1:9", tokenizer_path=directory)
        return TinkerServiceHolder(config).apply_chat_template(messages)

    with caplog.at_level("WARNING", logger="nexrl_tinker.holder"):
        assert prompt(ModelConfig(name="acme/tiny-chat")) == "User: 1+2=\n\nAssistant:"
        assert [prompt(TINY) for _ in range(2)] == ["<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"] * 2
    notices = [record.getMessage() for record in caplog.records]
    assert notices == [
        "renderer_name unset and tinker-cookbook recommends no renderer for nexrl-tiny: chats use the tokenizer's chat template "
        "(set backend.options.holder.renderer_name to choose one)"
    ]
    holder_module._recommended_renderer.cache_clear()


def test_pickles_to_config_and_sampling_path() -> None:
    holder = TinkerServiceHolder(
        TinkerHolderConfig(model=TINY, base_url="http://127.0.0.1:9"), sampling_path="tinker://run/sampler_weights/x"
    )
    clone = pickle.loads(pickle.dumps(holder))
    assert clone.config == holder.config
    assert clone.__getstate__() == {"config": holder.config, "sampling_path": "tinker://run/sampler_weights/x"}
