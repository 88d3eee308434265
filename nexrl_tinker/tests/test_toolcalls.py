"""A tool call the tiny model really samples through the Tinker SDK and NexRL's service
comes back from TinkerServiceHolder in OpenAI's shape (the kit's ToolCallContract)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from nexrl_tinker.holder import TinkerServiceHolder
from nexrl_tinker.holder_config import TinkerHolderConfig
from nexrl_tinker.testing import TEST_API_KEY

from nexrl_core.config import ModelConfig
from nexrl_core.testing import ToolCallContract


class TestTinkerHolderToolCalls(ToolCallContract):
    @pytest.fixture
    def holder(self, keyed_base_url: str) -> Iterator[TinkerServiceHolder]:
        config = TinkerHolderConfig(model=ModelConfig(name="nexrl-tiny"), base_url=keyed_base_url, api_key=TEST_API_KEY)
        holder = TinkerServiceHolder(config)
        try:
            yield holder
        finally:
            holder.close()
