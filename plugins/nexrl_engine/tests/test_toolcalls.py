"""Tool calls the tiny model really samples, through the in-process holder: the
conformance kit's ToolCallContract, and proof that the contract fails a holder that
drops tool calls or returns them in the wrong shape."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

from nexrl_core.config.schema import ModelConfig
from nexrl_core.testing import ToolCallContract
from nexrl_core.testing.toolcall_contract import check_tool_call, teach_tool_call
from nexrl_engine.inprocess.config import EngineHolderConfig
from nexrl_engine.inprocess.holder import EngineHolder


@pytest.fixture(scope="module")
def taught(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineHolder, object]]:
    holder = EngineHolder(EngineHolderConfig(model=ModelConfig(name="nexrl-tiny")), Path(tmp_path_factory.mktemp("tools")))
    try:
        yield holder, teach_tool_call(holder)
    finally:
        holder.close()


class TestEngineHolderToolCalls(ToolCallContract):
    @pytest.fixture
    def holder(self, tmp_path: Path) -> Iterator[EngineHolder]:
        holder = EngineHolder(EngineHolderConfig(model=ModelConfig(name="nexrl-tiny")), tmp_path)
        try:
            yield holder
        finally:
            holder.close()


def test_the_contract_fails_a_holder_that_drops_tool_calls(taught: tuple[EngineHolder, object]) -> None:
    _, result = taught
    with pytest.raises(AssertionError):
        check_tool_call(attrs.evolve(result, tool_calls=[]))


def test_the_contract_fails_arguments_that_were_changed(taught: tuple[EngineHolder, object]) -> None:
    _, result = taught
    (call,) = result.tool_calls
    wrong = {**call, "function": {"name": "add", "arguments": '{"a": 12}'}}
    with pytest.raises(AssertionError):
        check_tool_call(attrs.evolve(result, tool_calls=[wrong]))


def test_a_result_cannot_carry_arguments_that_are_not_a_json_string(taught: tuple[EngineHolder, object]) -> None:
    _, result = taught
    (call,) = result.tool_calls
    with pytest.raises(ValueError):
        attrs.evolve(result, tool_calls=[{**call, "function": {"name": "add", "arguments": {"a": 12, "b": 7}}}])


def test_the_contract_fails_markup_left_in_the_text(taught: tuple[EngineHolder, object]) -> None:
    _, result = taught
    with pytest.raises(AssertionError, match="visible text"):
        check_tool_call(attrs.evolve(result, response_text=result.response_text + "<tool_call>{}</tool_call>"))
