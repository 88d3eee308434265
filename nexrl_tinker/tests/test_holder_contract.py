"""TinkerServiceHolder passes the ServiceHolderContract and the LossOptionContract against
the real local service, through the real ``tinker`` SDK."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from nexrl_tinker.holder import TinkerServiceHolder
from nexrl_tinker.holder_config import TinkerHolderConfig
from nexrl_tinker.testing import TEST_API_KEY

from collections.abc import Sequence

from nexrl_core.config import ModelConfig
from nexrl_core.config.schema import DType
from nexrl_core.holders import TrainStepConfig
from nexrl_core.config.lora import LoraSettings
from nexrl_core.testing import ServiceHolderContract
from nexrl_core.testing.loss_option_contract import LossOptionCase, LossOptionContract
from nexrl_grpo.option_cases import LOSS_OPTION_CASES

TINY = ModelConfig(name="nexrl-tiny")


class TestTinkerHolderContract(ServiceHolderContract):
    @pytest.fixture
    def holder(self, keyed_base_url: str) -> Iterator[TinkerServiceHolder]:
        holder = TinkerServiceHolder(TinkerHolderConfig(model=TINY, base_url=keyed_base_url, api_key=TEST_API_KEY))
        try:
            yield holder
        finally:
            holder.close()


class TestTinkerHolderLossOptions(LossOptionContract):
    """On NexRL's service every option of every registered loss reaches the gradient."""

    @pytest.fixture
    def holder(self, keyed_base_url: str) -> Iterator[TinkerServiceHolder]:
        holder = TinkerServiceHolder(TinkerHolderConfig(model=TINY, base_url=keyed_base_url, api_key=TEST_API_KEY))
        try:
            assert holder.is_nexrl_service()
            yield holder
        finally:
            holder.close()

    @pytest.fixture
    def option_cases(self) -> Sequence[LossOptionCase]:
        return LOSS_OPTION_CASES


class TestHostedTinkerLossOptions(TestTinkerHolderLossOptions):
    """As against hosted Tinker: the holder sends only what hosted Tinker computes (clip
    widths become its ratio bounds, which our service honours as Tinker does) and
    refuses the rest before step 1."""

    @pytest.fixture
    def holder(self, keyed_base_url: str) -> Iterator[TinkerServiceHolder]:
        holder = TinkerServiceHolder(TinkerHolderConfig(model=TINY, base_url=keyed_base_url, api_key=TEST_API_KEY))
        holder._service_capabilities, holder._probed = None, True  # what a service without NexRL's capabilities route gets
        try:
            yield holder
        finally:
            holder.close()

    @pytest.fixture
    def refusals(self) -> dict[str, tuple[str, ...]]:
        """What hosted Tinker cannot compute: GSPO, any aggregation but a token sum (so no
        norm_constant), an entropy bonus, PPO's dual clip."""
        return {
            "cross_entropy": ("agg_mode", "norm_constant"),
            "importance_sampling": ("agg_mode", "norm_constant", "entropy_coeff"),
            "ppo": ("dual_clip_c", "agg_mode", "norm_constant", "entropy_coeff"),
            "cispo": ("agg_mode", "norm_constant", "entropy_coeff"),
            "gspo": ("clip_low", "clip_high", "agg_mode", "norm_constant", "entropy_coeff"),
        }

    def test_hosted_refusals_name_the_option(self, holder: TinkerServiceHolder, option_cases: Sequence[LossOptionCase]) -> None:
        refused = {
            (case.loss, key)
            for case in option_cases
            for key in holder.refused_options(case.step(case.other))
        }
        assert ("gspo", "loss_fn") in refused
        assert ("ppo", "loss_fn_config.dual_clip_c") in refused and ("ppo", "loss_fn_config.entropy_coeff") in refused
        assert ("ppo", "loss_fn_config.agg_mode") in refused and ("cispo", "loss_fn_config.norm_constant") in refused
        assert not {key for loss, key in refused if key.endswith(("clip_low", "clip_high")) and loss in ("ppo", "cispo")}


def test_lora_alpha_is_refused_where_the_tinker_api_has_none() -> None:
    lora = ModelConfig(name="nexrl-tiny", lora=LoraSettings(rank=8, alpha=16.0))
    holder = TinkerServiceHolder(TinkerHolderConfig(model=lora))
    assert "no LoRA alpha" in holder.refused_options(LOSS_OPTION_CASES[0].step("token-sum"))["model.lora.alpha"]


def test_checkpoint_round_trip(keyed_base_url: str, tmp_path: Path) -> None:
    holder = TinkerServiceHolder(TinkerHolderConfig(model=TINY, base_url=keyed_base_url, api_key=TEST_API_KEY))
    try:
        path = holder.save_checkpoint("contract")
        assert path.startswith("tinker://") and path.endswith("/weights/contract")
        holder.load_checkpoint(path)
        assert holder.update_sampling_weights().startswith("tinker://")
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
    """``model.lora.train_{mlp,attn,unembed}`` travel through ``create_lora_training_client``
    and decide which layers the service adapts (read back from the exported adapter)."""
    model = ModelConfig(name="nexrl-tiny", lora=LoraSettings(rank=4, **flags))
    holder = TinkerServiceHolder(TinkerHolderConfig(model=model, base_url=keyed_base_url, api_key=TEST_API_KEY))
    try:
        holder.update_sampling_weights()
        directory = holder.export_model(tmp_path / "model")
    finally:
        holder.close()
    targets = set(json.loads((directory / "adapter" / "adapter_config.json").read_text())["target_modules"])
    assert adapted <= targets and not untouched & targets, targets


def test_model_dtype_must_be_what_the_service_trains_in(keyed_base_url: str) -> None:
    """The module's service runs in fp32 and says so; a bf16 recipe is refused with the
    flag that would start a bf16 service, and hosted Tinker (which says nothing) takes only
    the default."""
    bf16 = ModelConfig(name="nexrl-tiny", dtype=DType.BF16)
    holder = TinkerServiceHolder(TinkerHolderConfig(model=bf16, base_url=keyed_base_url, api_key=TEST_API_KEY))
    try:
        assert holder.run_info() == {"dtype": "float32", "device": "cpu", "max_context_length": "2048"}
        refused = holder.refused_options(TrainStepConfig())
        assert "--dtype bf16" in refused["model.dtype"] and "trains in fp32" in refused["model.dtype"]
        holder._service_capabilities, holder._probed = None, True  # hosted: no NexRL capabilities route
        assert "hosted service does not say" in holder.refused_options(TrainStepConfig())["model.dtype"]
        assert holder.run_info() == {}
    finally:
        holder.close()


def test_gradient_checkpointing_is_refused_before_step_1_by_name() -> None:
    """The Tinker API has no activation-checkpointing setting, so a recipe asking for it
    stops where the remote_api backend checks the holder, naming the key."""
    from nexrl_core.config import ConfigError, load_config
    from nexrl_core.holder_backend import HolderBackend

    config = load_config(None, ["model.name=nexrl-tiny", "model.gradient_checkpointing=true"])
    holder = TinkerServiceHolder(TinkerHolderConfig(model=config.model))
    trainer = type("T", (), {"train_step": LOSS_OPTION_CASES[0].step("token-sum")})()
    with pytest.raises(ConfigError, match="model.gradient_checkpointing: backend 'remote_api' cannot honour it: the Tinker API has no activation-checkpointing"):
        HolderBackend(holder, trainer, name="remote_api", work_dir=Path("unused"))  # type: ignore[arg-type]
