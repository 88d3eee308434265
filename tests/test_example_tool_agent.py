"""examples/tool_agent: the multi-turn tool agent trains as shipped, and when the model
really calls the tool the agent runs it, feeds the result back, and the turns merge into
one trajectory whose tool result is context, not trained."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from nexrl_core.config.schema import ModelConfig
from nexrl_core.run.llm_client import LLMClient, SamplingDefaults
from nexrl_core.run.rollout import build_trajectories
from nexrl_core.testing import toolcall_contract

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tool_agent"


def calculator() -> object:
    spec = importlib.util.spec_from_file_location("calculator", EXAMPLE / "calculator.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def taught_holder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """The tiny model in-process, taught the conformance kit's tool-use reply (same prompt
    and tool as the example's for 12+7)."""
    from nexrl_engine.inprocess.config import EngineHolderConfig
    from nexrl_engine.inprocess.holder import EngineHolder

    holder = EngineHolder(EngineHolderConfig(model=ModelConfig(name="nexrl-tiny")), tmp_path_factory.mktemp("taught"))
    try:
        toolcall_contract.teach_tool_call(holder)
        yield holder
    finally:
        holder.close()


@pytest.mark.slow
def test_a_real_tool_call_runs_the_tool_and_merges_the_turns(taught_holder: object) -> None:
    agent = calculator()
    assert agent.TOOLS == toolcall_contract.TOOLS  # the taught prompt is the example's
    llm = LLMClient(taught_holder, SamplingDefaults(max_tokens=32, temperature=0.0, top_p=1.0), seed=0)
    outcome = agent.solve({"a": 12, "b": 7}, llm)
    assert outcome["tool_calls"] == 1.0
    assert len(llm.calls) == 2, "a tool call, then a turn that sees its result"
    (trajectory,) = build_trajectories(llm.calls, reward=outcome["reward"], group_id="g", run_id=0, task_id="t")
    first, second = llm.calls
    gap = len(first.prompt_tokens) + len(first.response_tokens)
    tool_turn = trajectory.loss_mask[gap : len(second.prompt_tokens)]
    assert tool_turn and not any(tool_turn), "the tool result is context"
    assert all(trajectory.loss_mask[len(second.prompt_tokens) :]), "the model's answer is trained"


def test_a_bad_tool_call_is_an_observation() -> None:
    agent = calculator()
    assert agent.run_tool("add", '{"a": 2, "b": 3}') == "5"
    assert agent.run_tool("mul", "{}").startswith("error: unknown tool")
    assert agent.run_tool("add", '{"a": 2}').startswith("error: add takes")


@pytest.mark.slow
def test_the_example_trains(tmp_path: Path) -> None:
    nexrl = Path(sys.executable).with_name("nexrl")
    command = [str(nexrl), "train", str(EXAMPLE / "recipe.yaml"), "schedule.steps=2", "schedule.validate_every=2", f"output.dir={tmp_path}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(any("tool_calls" in key for key in row) for row in rows if row.get("step", 0) >= 1)
