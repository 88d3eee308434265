"""WeaverServiceHolder passes the ServiceHolderContract against the real local service."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from nexrl_weaver.holder import WeaverServiceHolder
from nexrl_weaver.holder_config import WeaverHolderConfig
from nexrl_weaver.testing import TEST_API_KEY

from nexrl_core.config import ModelConfig
from nexrl_core.config.lora import LoraSettings
from nexrl_core.holders import TrainStepConfig
from nexrl_core.model_export import ModelExportError
from nexrl_core.testing import ServiceHolderContract
from nexrl_core.testing.loss_option_contract import LossOptionCase, LossOptionContract
from nexrl_core.types import RemoteDatum
from nexrl_grpo.option_cases import LOSS_OPTION_CASES

TINY = ModelConfig(name="nexrl-tiny")


class TestWeaverHolderContract(ServiceHolderContract):
    @pytest.fixture
    def holder(self, keyed_base_url: str) -> Iterator[WeaverServiceHolder]:
        holder = WeaverServiceHolder(WeaverHolderConfig(model=TINY, base_url=keyed_base_url, api_key=TEST_API_KEY))
        try:
            yield holder
        finally:
            holder.close()


class TestWeaverLoraHolderContract(ServiceHolderContract):
    """The same bar with a LoRA model over ``http-binary`` tensors."""

    @pytest.fixture
    def holder(self, keyed_base_url: str) -> Iterator[WeaverServiceHolder]:
        config = WeaverHolderConfig(
            model=ModelConfig(name="nexrl-tiny", lora=LoraSettings(rank=8)), base_url=keyed_base_url, api_key=TEST_API_KEY, tensor_transport="http-binary"
        )
        holder = WeaverServiceHolder(config)
        try:
            yield holder
        finally:
            holder.close()


class TestWeaverHolderLossOptions(LossOptionContract):
    """On NexRL's Weaver service every option of every registered loss reaches the gradient."""

    @pytest.fixture
    def holder(self, keyed_base_url: str) -> Iterator[WeaverServiceHolder]:
        holder = WeaverServiceHolder(WeaverHolderConfig(model=TINY, base_url=keyed_base_url, api_key=TEST_API_KEY))
        try:
            assert holder.is_nexrl_service()
            yield holder
        finally:
            holder.close()

    @pytest.fixture
    def option_cases(self) -> Sequence[LossOptionCase]:
        return LOSS_OPTION_CASES


class TestHostedWeaverLossOptions(TestWeaverHolderLossOptions):
    """As against hosted Weaver: what it cannot compute is refused before step 1, the rest
    still changes the gradient."""

    @pytest.fixture
    def holder(self, keyed_base_url: str) -> Iterator[WeaverServiceHolder]:
        holder = WeaverServiceHolder(WeaverHolderConfig(model=TINY, base_url=keyed_base_url, api_key=TEST_API_KEY))
        holder._service_capabilities, holder._probed = None, True  # what a service without NexRL's capabilities route gets
        try:
            yield holder
        finally:
            holder.close()

    @pytest.fixture
    def refusals(self) -> dict[str, tuple[str, ...]]:
        """What hosted Weaver cannot compute: only cross-entropy and importance sampling,
        summed over tokens (so no norm_constant), with an entropy bonus."""
        every = ("clip_low", "clip_high", "agg_mode", "norm_constant", "entropy_coeff")
        return {
            "cross_entropy": ("agg_mode", "norm_constant"),
            "importance_sampling": ("agg_mode", "norm_constant"),
            "ppo": (*every, "dual_clip_c"),
            "cispo": every,
            "gspo": every,
        }


def test_lora_alpha_is_refused_where_the_weaver_api_has_none() -> None:
    holder = WeaverServiceHolder(WeaverHolderConfig(model=ModelConfig(name="nexrl-tiny", lora=LoraSettings(rank=8, alpha=16.0))))
    assert "no LoRA alpha" in holder.refused_options(LOSS_OPTION_CASES[0].step("token-sum"))["model.lora.alpha"]


def test_checkpoint_round_trip_into_a_new_holder(keyed_base_url: str) -> None:
    """What resume does: a new holder (a new session and model) loads the last checkpoint."""
    config = WeaverHolderConfig(model=TINY, base_url=keyed_base_url, api_key=TEST_API_KEY)
    first, second = WeaverServiceHolder(config), WeaverServiceHolder(config)
    try:
        path = first.save_checkpoint("contract")
        assert path.startswith("weaver://") and path.endswith("/checkpoints/contract")
        second.load_checkpoint(path)
        assert second.update_sampling_weights().startswith("weaver://")
    finally:
        first.close()
        second.close()


def test_hosted_weaver_without_a_key_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WEAVER_API_KEY", raising=False)
    monkeypatch.delenv("WEAVER_BASE_URL", raising=False)
    holder = WeaverServiceHolder(WeaverHolderConfig(model=TINY))
    with pytest.raises(ValueError, match="WEAVER_API_KEY"):
        holder.apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_wrong_key_fails_with_the_service_message(keyed_base_url: str) -> None:
    holder = WeaverServiceHolder(WeaverHolderConfig(model=TINY, base_url=keyed_base_url, api_key="sk-wrong", max_retries=0))
    with pytest.raises(RuntimeError, match="401.*invalid API key"):
        holder.update_sampling_weights()


def test_local_service_honours_every_loss_option(keyed_base_url: str) -> None:
    holder = WeaverServiceHolder(WeaverHolderConfig(model=TINY, base_url=keyed_base_url, api_key=TEST_API_KEY))
    step = TrainStepConfig(loss_fn="ppo", loss_fn_config={"clip_low": 0.1, "agg_mode": "token-mean", "entropy_coeff": 0.01})
    assert holder.is_nexrl_service() and holder.refused_options(step) == {}


def test_export_is_refused_while_sampling_lags_the_training_weights(keyed_base_url: str, tmp_path) -> None:
    """A step after the last update_sampling_weights: exporting the current weights would
    not be what sampling uses, so the holder refuses until sampling catches up."""
    holder = WeaverServiceHolder(WeaverHolderConfig(model=TINY, base_url=keyed_base_url, api_key=TEST_API_KEY))
    try:
        holder.update_sampling_weights()
        tokens = [1, 5, 9, 14, 20]
        datum = RemoteDatum(
            input_tokens=tokens[:-1], target_tokens=tokens[1:], sampling_logprobs=[0.0] * 4, advantages=[0.0] * 4, loss_mask=[1.0] * 4
        )
        holder.train([datum], TrainStepConfig(loss_fn="cross_entropy"))
        with pytest.raises(ModelExportError, match="call update_sampling_weights"):
            holder.export_model(tmp_path / "stale")
        assert not (tmp_path / "stale").exists()
        holder.update_sampling_weights()
        assert (holder.export_model(tmp_path / "fresh") / "config.json").is_file()
    finally:
        holder.close()


@pytest.mark.parametrize(
    ("flags", "adapted", "untouched"),
    [
        ({"train_mlp": False}, {"q_proj", "o_proj", "lm_head"}, {"gate_proj", "down_proj"}),
        ({"train_attn": False, "train_unembed": False}, {"gate_proj", "down_proj"}, {"q_proj", "o_proj", "lm_head"}),
    ],
)
def test_lora_targets_reach_the_service(keyed_base_url: str, tmp_path: Path, flags: dict, adapted: set, untouched: set) -> None:
    """``model.lora.train_{mlp,attn,unembed}`` decide which layers the service adapts (read
    back from the exported adapter)."""
    model = ModelConfig(name="nexrl-tiny", lora=LoraSettings(rank=4, **flags))
    holder = WeaverServiceHolder(WeaverHolderConfig(model=model, base_url=keyed_base_url, api_key=TEST_API_KEY))
    try:
        holder.update_sampling_weights()
        directory = holder.export_model(tmp_path / "model")
    finally:
        holder.close()
    targets = set(json.loads((directory / "adapter" / "adapter_config.json").read_text())["target_modules"])
    assert adapted <= targets and not untouched & targets, targets


def test_gradient_checkpointing_is_refused_before_step_1_by_name() -> None:
    """The Weaver API has no activation-checkpointing setting: refused by key where the
    remote_api backend checks the holder."""
    from nexrl_core.config import ConfigError, load_config
    from nexrl_core.holder_backend import HolderBackend

    config = load_config(None, ["model.name=nexrl-tiny", "model.gradient_checkpointing=true"])
    holder = WeaverServiceHolder(WeaverHolderConfig(model=config.model))
    trainer = type("T", (), {"train_step": LOSS_OPTION_CASES[0].step("token-sum")})()
    with pytest.raises(ConfigError, match="model.gradient_checkpointing: backend 'remote_api' cannot honour it: the Weaver API has no activation-checkpointing"):
        HolderBackend(holder, trainer, name="remote_api", work_dir=Path("unused"))  # type: ignore[arg-type]
