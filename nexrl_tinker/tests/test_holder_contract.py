"""TinkerServiceHolder passes the ServiceHolderContract against the real local service."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from nexrl_tinker.holder import TinkerServiceHolder
from nexrl_tinker.holder_config import TinkerHolderConfig
from nexrl_tinker.testing import TEST_API_KEY

from nexrl_core.testing import ServiceHolderContract

from nexrl_core.config import ModelConfig

TINY = ModelConfig(name="nexrl-tiny")


class TestTinkerHolderContract(ServiceHolderContract):
    @pytest.fixture
    def holder(self, keyed_base_url: str) -> Iterator[TinkerServiceHolder]:
        holder = TinkerServiceHolder(TinkerHolderConfig(model=TINY, base_url=keyed_base_url, api_key=TEST_API_KEY))
        try:
            yield holder
        finally:
            holder.close()


def test_checkpoint_round_trip(keyed_base_url: str, tmp_path: Path) -> None:
    holder = TinkerServiceHolder(TinkerHolderConfig(model=TINY, base_url=keyed_base_url, api_key=TEST_API_KEY))
    try:
        path = holder.save_checkpoint("contract")
        assert path.startswith("tinker://") and path.endswith("/weights/contract")
        holder.load_checkpoint(path)
        assert holder.update_sampling_weights().startswith("tinker://")
    finally:
        holder.close()
