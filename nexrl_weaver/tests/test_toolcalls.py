"""A tool call the tiny model really samples through the nex-weaver SDK and NexRL's Weaver service
comes back from WeaverServiceHolder in OpenAI's shape (the kit's ToolCallContract)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from nexrl_weaver.holder import WeaverServiceHolder
from nexrl_weaver.holder_config import WeaverHolderConfig
from nexrl_weaver.testing import TEST_API_KEY

from nexrl_core.config import ModelConfig
from nexrl_core.testing import ToolCallContract


class TestWeaverHolderToolCalls(ToolCallContract):
    @pytest.fixture
    def holder(self, keyed_base_url: str) -> Iterator[WeaverServiceHolder]:
        config = WeaverHolderConfig(model=ModelConfig(name="nexrl-tiny"), base_url=keyed_base_url, api_key=TEST_API_KEY)
        holder = WeaverServiceHolder(config)
        try:
            yield holder
        finally:
            holder.close()
