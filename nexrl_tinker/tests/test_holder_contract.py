"""TinkerServiceHolder against the real local service, through the real ``tinker`` SDK:
every SDK holder's contract (`nexrl_remote_api.testing`), and hosted Tinker's refusals."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from nexrl_core.testing.loss_option_contract import LossOptionCase
from nexrl_remote_api.testing import HostedSdkHolderLossOptions, SdkHolderContract, SdkHolderLossOptions
from nexrl_tinker.holder import TinkerServiceHolder


class TestTinkerHolder(SdkHolderContract):
    """Every SDK holder's contract, on the tinker SDK."""


class TestTinkerHolderLossOptions(SdkHolderLossOptions):
    """On NexRL's Tinker service every option of every registered loss reaches the gradient."""


class TestHostedTinkerLossOptions(HostedSdkHolderLossOptions):
    """Hosted Tinker: clip widths become its ratio bounds, which our service honours as
    Tinker does."""

    @pytest.fixture
    def refusals(self) -> dict[str, tuple[str, ...]]:
        """What hosted Tinker cannot compute: GSPO, any aggregation but a token sum (so no
        norm_constant), an entropy bonus, PPO's dual clip; and DRO, which hosted Tinker
        has but this holder does not yet send it."""
        return {
            "cross_entropy": ("agg_mode", "norm_constant"),
            "importance_sampling": ("agg_mode", "norm_constant", "entropy_coeff"),
            "ppo": ("dual_clip_c", "agg_mode", "norm_constant", "entropy_coeff"),
            "cispo": ("agg_mode", "norm_constant", "entropy_coeff"),
            "gspo": ("clip_low", "clip_high", "agg_mode", "norm_constant", "entropy_coeff"),
            "dro": ("beta", "agg_mode", "norm_constant"),
        }

    def test_hosted_refusals_name_the_option(self, holder: TinkerServiceHolder, option_cases: Sequence[LossOptionCase]) -> None:
        refused = {(case.loss, key) for case in option_cases for key in holder.refused_options(case.step(case.other))}
        assert ("gspo", "loss_fn") in refused
        assert ("ppo", "loss_fn_config.dual_clip_c") in refused and ("ppo", "loss_fn_config.entropy_coeff") in refused
        assert ("ppo", "loss_fn_config.agg_mode") in refused and ("cispo", "loss_fn_config.norm_constant") in refused
        assert not {key for loss, key in refused if key.endswith(("clip_low", "clip_high")) and loss in ("ppo", "cispo")}
