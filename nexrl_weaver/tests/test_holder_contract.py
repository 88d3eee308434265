"""WeaverServiceHolder against the real local service, through the real ``nex-weaver`` SDK:
every SDK holder's contract (`nexrl_remote_api.testing`), over JSON and ``http-binary``
tensors, hosted Weaver's refusals, and how it finds its key."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from nexrl_core.config import ModelConfig
from nexrl_core.config.lora import LoraSettings
from nexrl_core.testing import ServiceHolderContract
from nexrl_remote_api.testing import HostedSdkHolderLossOptions, SdkHolderContract, SdkHolderKit, SdkHolderLossOptions
from nexrl_weaver.holder import WeaverServiceHolder
from nexrl_weaver.holder_config import WeaverHolderConfig

TINY = ModelConfig(name="nexrl-tiny")


class TestWeaverHolder(SdkHolderContract):
    """Every SDK holder's contract, on the nex-weaver SDK."""


class TestWeaverLoraHolderContract(ServiceHolderContract):
    """The service-holder contract with a LoRA model over ``http-binary`` tensors."""

    @pytest.fixture
    def holder(self, holder_kit: SdkHolderKit, keyed_base_url: str) -> Iterator[WeaverServiceHolder]:
        holder = holder_kit.holder(
            keyed_base_url, ModelConfig(name="nexrl-tiny", lora=LoraSettings(rank=8)), tensor_transport="http-binary"
        )
        try:
            yield holder
        finally:
            holder.close()


class TestWeaverHolderLossOptions(SdkHolderLossOptions):
    """On NexRL's Weaver service every option of every registered loss reaches the gradient."""


class TestHostedWeaverLossOptions(HostedSdkHolderLossOptions):
    """As against hosted Weaver."""

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
            "dro": ("beta", "agg_mode", "norm_constant"),
        }


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
