"""Rollout pieces: dataloader grouping, the OpenAI-shaped client, trajectories, the worker pool."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from nexrl_core.chat.model import SamplingOptions
from nexrl_core.config import ConfigError, RolloutConfig, TaskConfig
from nexrl_core.run.completions import ChatCompletion
from nexrl_core.run.data import DataLoader, ListItems, TaskData, TaskItems, resolve_task
from nexrl_core.run.data_files import read_jsonl
from nexrl_core.run.llm_client import LLMClient, RolloutCancelled, SamplingDefaults
from nexrl_core.run.rollout import (
    RolloutBatch,
    RolloutError,
    RolloutRunner,
    RunResult,
    build_trajectories,
    check_error_budget,
    parse_outcome,
)
from nexrl_core.run.seeding import call_seed, derive_seed
from nexrl_core.types import SampleResult

TOOL_CALL = {"id": "call-1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}


class EchoHolder:
    """Tokens are characters; the reply is ``"ok<seed>"``; records every call's options."""

    def __init__(self, delay: float = 0.0, tool_calls: bool = False) -> None:
        self.delay = delay
        self.tool_calls = tool_calls
        self.options: list[SamplingOptions] = []
        self.active = 0
        self.max_active = 0
        self._lock = threading.Lock()

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, tokenize=False):  # noqa: ANN001
        text = "".join(f"<{m['role']}>{m['content'] or ''}</{m['role']}>" for m in messages) + "<assistant>" * add_generation_prompt
        return [ord(char) for char in text] if tokenize else text

    def sample_from_messages(self, messages, options, tools=None):  # noqa: ANN001
        return self.sample_from_prompt(self.apply_chat_template(messages, tokenize=True), options)

    def sample_from_prompt(self, prompt, options):  # noqa: ANN001
        with self._lock:
            self.options.append(options)
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        time.sleep(self.delay)
        with self._lock:
            self.active -= 1
        reply = f"ok{options.seed % 97}"
        tokens = [ord(char) for char in reply + "</assistant>"]
        return SampleResult(
            prompt_tokens=list(prompt),
            response_tokens=tokens,
            response_logprobs=[-0.5] * len(tokens),
            response_text=reply,
            tool_calls=[TOOL_CALL] if self.tool_calls else [],
            finish_reason="stop",
        )


def sample(prompt: Sequence[int], response: Sequence[int], finish: str = "stop") -> SampleResult:
    return SampleResult(
        prompt_tokens=list(prompt),
        response_tokens=list(response),
        response_logprobs=[-0.25] * len(response),
        response_text="",
        finish_reason=finish,
    )


DEFAULTS = SamplingDefaults(max_tokens=16, temperature=0.7, top_p=0.9)


# --- dataloader -----------------------------------------------------------------------------------


def counting_task(size: int | None = None) -> TaskData:
    def train_items(seed: int):  # noqa: ANN202
        for index in range(size or 10**9):
            yield {"q": f"{seed}-{index}"}

    return TaskData(name="t", agent=lambda item, llm: 0.0, train=TaskItems(train_items, seed=5), val_items=[({"q": "v"}, "v0")])


def test_each_prompt_is_repeated_group_size_times_with_group_and_run_ids() -> None:
    loader = DataLoader(counting_task(), prompts_per_step=3, group_size=4, seed=1)
    requests = loader.requests(2)
    assert [(r.group_id, r.run_id) for r in requests] == [(f"s2-p{p}", run) for p in range(3) for run in range(4)]
    assert [r.item["q"] for r in requests[::4]] == ["5-3", "5-4", "5-5"]
    assert all(r.step == 2 and not r.is_val for r in requests)
    assert len({r.seed for r in requests}) == 3  # one seed per group; runs differ by run_id
    assert requests[5].seed == derive_seed(1, "train", 2, 1)
    assert [r.task_id for r in requests] == [requests[0].task_id] * 4 + [requests[4].task_id] * 4 + [requests[8].task_id] * 4


def test_steps_can_be_read_in_any_order_with_the_same_items() -> None:
    forward = DataLoader(counting_task(size=7), prompts_per_step=3, group_size=1, seed=0)
    items = {step: [r.item["q"] for r in forward.requests(step)] for step in (1, 2, 3, 4)}
    backward = DataLoader(counting_task(size=7), prompts_per_step=3, group_size=1, seed=0)
    assert {step: [r.item["q"] for r in backward.requests(step)] for step in (4, 2, 3, 1)} == items
    # a finite task restarts with a derived seed after its items run out
    assert items[3][0] == "5-6" and items[3][1] == f"{derive_seed(5, 'task-epoch', 1)}-0"


def test_list_items_reshuffle_every_epoch_deterministically() -> None:
    stream = ListItems([{"i": i} for i in range(5)], [str(i) for i in range(5)], seed=2)
    first, second = stream.take(0, 5), stream.take(5, 5)
    assert sorted(item["i"] for item, _ in first) == list(range(5)) == sorted(item["i"] for item, _ in second)
    assert first != second
    assert ListItems([{"i": i} for i in range(5)], [str(i) for i in range(5)], seed=2).take(3, 4) == stream.take(3, 4)


def test_validation_requests_are_one_run_per_item_with_step_independent_seeds() -> None:
    loader = DataLoader(counting_task(), prompts_per_step=3, group_size=4, seed=1)
    (first,) = loader.val_requests(0)
    (later,) = loader.val_requests(10)
    assert first.is_val and first.run_id == 0 and first.task_id == "v0"
    assert first.seed == later.seed


def test_read_jsonl_reports_every_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text('{"a": 1}\n\nnot json\n[1, 2]\n')
    with pytest.raises(ConfigError) as caught:
        read_jsonl(path, "task.data_path")
    assert caught.value.problems == [
        f"task.data_path: {path}: line 3 is not valid JSON (Expecting value)",
        f"task.data_path: {path}: line 4 must be a JSON object, got list",
    ]


def test_resolve_task_from_jsonl_needs_an_agent(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").write_text(json.dumps({"id": 7, "x": 1}) + "\n")
    with pytest.raises(ConfigError, match="task.agent: required with task.data_path"):
        resolve_task(TaskConfig(name="unregistered", data_path=str(tmp_path / "d.jsonl")), seed=0)
    with pytest.raises(ConfigError, match="task.agent: required with task.data_path"):
        resolve_task(TaskConfig(data_path=str(tmp_path / "d.jsonl")), seed=0)
    with pytest.raises(ConfigError, match="task.agent: cannot import module 'no_such_module_xyz'"):
        resolve_task(TaskConfig(data_path=str(tmp_path / "d.jsonl"), agent="no_such_module_xyz:run"), seed=0)
    task = resolve_task(TaskConfig(data_path="d.jsonl", agent="json:dumps"), seed=0, recipe_dir=tmp_path)
    assert task.agent is json.dumps and task.val_items == []
    assert task.train.take(0, 1) == [({"id": 7, "x": 1}, "7")]


# --- the client -----------------------------------------------------------------------------------


def test_the_client_returns_an_openai_shaped_completion_with_tokens() -> None:
    holder = EchoHolder()
    llm = LLMClient(holder, DEFAULTS, seed=11)
    completion = llm.chat.completions.create(model="whatever", messages=[{"role": "user", "content": "hi"}])
    assert isinstance(completion, ChatCompletion) and completion.object == "chat.completion"
    choice = completion.choices[0]
    assert choice.index == 0 and choice.finish_reason == "stop"
    assert choice.message.role == "assistant" and choice.message.content == f"ok{derive_seed(11, 0) % 97}"
    assert choice.message.tool_calls is None
    assert completion.usage.prompt_tokens == len(completion.nexrl.prompt_tokens)
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens
    assert completion.nexrl.response_logprobs == [-0.5] * completion.usage.completion_tokens
    assert llm.calls == [completion.nexrl]
    (options,) = holder.options
    assert (options.max_tokens, options.temperature, options.top_p, options.seed) == (16, 0.7, 0.9, derive_seed(11, 0))
    assert choice.message.to_dict() == {"role": "assistant", "content": choice.message.content}


def test_call_arguments_override_the_recipe_and_seeds_follow_the_call_index() -> None:
    holder = EchoHolder()
    llm = LLMClient(holder, DEFAULTS, seed=11)
    messages = [{"role": "user", "content": "hi"}]
    llm.chat.completions.create(messages=messages, max_tokens=3, temperature=0.0, top_p=0.5, stop="\n")
    llm.chat.completions.create(messages=messages, seed=1)
    first, second = holder.options
    assert (first.max_tokens, first.temperature, first.top_p, first.stop) == (3, 0.0, 0.5, ["\n"])
    assert second.seed == derive_seed(11, 1, 1) != first.seed == derive_seed(11, 0)


def test_the_runs_of_a_group_get_consecutive_seeds_for_the_same_call() -> None:
    """What lets a holder merge a group's identical requests into one (nexrl_core.training.coalesce)."""
    holders = [EchoHolder() for _ in range(4)]
    for run_id, holder in enumerate(holders):
        llm = LLMClient(holder, DEFAULTS, seed=11, run_id=run_id)
        for _ in range(2):
            llm.chat.completions.create(messages=[{"role": "user", "content": "hi"}])
    for call in range(2):
        seeds = [holder.options[call].seed for holder in holders]
        assert seeds == [call_seed(11, call, 0) + run for run in range(4)]
    assert call_seed(11, 0, 0) != call_seed(11, 1, 0)
    assert 0 <= call_seed(2**31 - 1, 0, 10**6) < 2**31


def test_tool_calls_come_back_as_openai_objects() -> None:
    llm = LLMClient(EchoHolder(tool_calls=True), DEFAULTS, seed=0)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    completion = llm.chat.completions.create(messages=[{"role": "user", "content": "1+1"}], tools=tools)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert (call.id, call.type, call.function.name, json.loads(call.function.arguments)) == (
        "call-1",
        "function",
        "add",
        {"a": 1},
    )
    assert choice.message.to_dict()["tool_calls"] == [TOOL_CALL]


def test_unsupported_arguments_are_refused() -> None:
    llm = LLMClient(EchoHolder(), DEFAULTS, seed=0)
    with pytest.raises(TypeError, match="logit_bias"):
        llm.chat.completions.create(messages=[], logit_bias={})
    with pytest.raises(ValueError, match="n=2"):
        llm.chat.completions.create(messages=[], n=2)


def test_a_stopping_run_cancels_the_next_call() -> None:
    stop = threading.Event()
    stop.set()
    llm = LLMClient(EchoHolder(), DEFAULTS, seed=0, stop_event=stop)
    with pytest.raises(RolloutCancelled):
        llm.chat.completions.create(messages=[{"role": "user", "content": "hi"}])


# --- trajectories ---------------------------------------------------------------------------------


def test_a_single_call_is_prompt_with_mask_0_then_response_with_mask_1() -> None:
    (trajectory,) = build_trajectories([sample([1, 2, 3], [4, 5])], reward=1.0, group_id="g", run_id=2, task_id="t")
    assert trajectory.tokens == [1, 2, 3, 4, 5]
    assert trajectory.loss_mask == [0, 0, 0, 1, 1]
    assert trajectory.logprobs == [0.0, 0.0, 0.0, -0.25, -0.25]
    assert (trajectory.reward, trajectory.group_id, trajectory.run_id, trajectory.task_id) == (1.0, "g", 2, "t")


def test_calls_that_extend_the_conversation_merge_with_the_gap_masked() -> None:
    calls = [sample([1, 2], [3, 4]), sample([1, 2, 3, 4, 9, 9], [5]), sample([7], [8]), sample([7, 8, 6], [1])]
    first, second = build_trajectories(calls, reward=0.5, group_id="g", run_id=0, task_id="t")
    assert first.tokens == [1, 2, 3, 4, 9, 9, 5]
    assert first.loss_mask == [0, 0, 1, 1, 0, 0, 1]
    assert first.logprobs == [0.0, 0.0, -0.25, -0.25, 0.0, 0.0, -0.25]
    assert second.tokens == [7, 8, 6, 1] and second.loss_mask == [0, 1, 0, 1]
    assert first.reward == second.reward == 0.5
    assert (first.extra["calls"], second.extra["calls"]) == ([0, 1], [2, 3])
    assert (first.extra["trajectory_index"], second.extra["trajectory_index"]) == (0, 1)


def test_a_call_that_rewrites_history_starts_a_new_trajectory() -> None:
    calls = [sample([1, 2], [3]), sample([1, 5, 3], [4])]
    trajectories = build_trajectories(calls, reward=0.0, group_id="g", run_id=0, task_id="t")
    assert [t.tokens for t in trajectories] == [[1, 2, 3], [1, 5, 3, 4]]


def test_a_real_multi_turn_agent_becomes_one_trajectory() -> None:
    holder = EchoHolder()
    llm = LLMClient(holder, DEFAULTS, seed=4)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "1+1"}]
    first = llm.chat.completions.create(messages=messages)
    messages += [
        first.choices[0].message,
        {"role": "tool", "content": "2"},
    ]  # the message object, as OpenAI's SDK allows
    llm.chat.completions.create(messages=messages)
    (trajectory,) = build_trajectories(llm.calls, reward=1.0, group_id="g", run_id=0, task_id="t")
    text = "".join(chr(token) for token, flag in zip(trajectory.tokens, trajectory.loss_mask) if flag)
    assert text.count("</assistant>") == 2 and "<tool>" not in text
    assert "<tool>2</tool>" in "".join(chr(token) for token in trajectory.tokens)


@pytest.mark.parametrize(
    ("outcome", "expected"),
    [(1, (1.0, {})), (0.5, (0.5, {})), ({"reward": 1, "len": 3, "note": "x", "flag": True}, (1.0, {"len": 3.0}))],
)
def test_parse_outcome(outcome: Any, expected: tuple[float, dict[str, float]]) -> None:
    assert parse_outcome(outcome) == expected


@pytest.mark.parametrize("outcome", [None, "1", float("nan"), True, {"score": 1}])
def test_parse_outcome_rejects(outcome: Any) -> None:
    with pytest.raises(ValueError):
        parse_outcome(outcome)


# --- the runner -----------------------------------------------------------------------------------


def requests_for(count: int, group_size: int = 1) -> list[Any]:
    task = TaskData(
        name="t",
        agent=lambda item, llm: 0.0,
        train=ListItems([{"i": i} for i in range(count)], [str(i) for i in range(count)], seed=0),
        val_items=[],
    )
    return DataLoader(task, prompts_per_step=count, group_size=group_size, seed=0).requests(1)


def one_call_agent(item: Mapping[str, Any], llm: LLMClient) -> float:
    completion = llm.chat.completions.create(messages=[{"role": "user", "content": str(item["i"])}])
    return float(completion.choices[0].message.content.endswith("0"))


def test_concurrency_is_bounded_and_results_keep_request_order() -> None:
    holder = EchoHolder(delay=0.03)
    runner = RolloutRunner(holder, one_call_agent, concurrency=RolloutConfig(concurrency=3).runs_in_flight(), defaults=DEFAULTS)
    try:
        batch = runner.submit(1, requests_for(12)).result()
    finally:
        runner.close()
    assert holder.max_active == 3
    assert [run.item_index for run in batch.runs] == list(range(12))
    assert [t.group_id for t in batch.trajectories] == [f"s1-p{i}" for i in range(12)]


def test_results_do_not_depend_on_concurrency() -> None:
    results = []
    for concurrency in (1, 5):
        runner = RolloutRunner(EchoHolder(delay=0.001), one_call_agent, concurrency=concurrency, defaults=DEFAULTS)
        try:
            results.append(runner.submit(1, requests_for(6, group_size=3)).result())
        finally:
            runner.close()
    assert results[0] == results[1]


def test_a_failing_agent_fails_only_its_run(caplog: pytest.LogCaptureFixture) -> None:
    def agent(item: Mapping[str, Any], llm: LLMClient) -> float:
        if item["i"] == 2:
            raise KeyError("boom")
        return one_call_agent(item, llm)

    runner = RolloutRunner(EchoHolder(), agent, concurrency=2, defaults=DEFAULTS)
    try:
        batch = runner.submit(1, requests_for(4)).result()
    finally:
        runner.close()
    (failed,) = batch.errors
    assert failed.task_id == "2" and failed.error == "KeyError: 'boom'" and failed.reward is None
    assert batch.metrics()["rollout/agent_errors"] == 1 and batch.metrics()["rollout/runs"] == 4
    assert "agent run failed (step 1, task 2, run 0)" in caplog.text and "KeyError" in caplog.text
    check_error_budget(batch, fraction=0.25, total_errors=1, max_total=None, what="step 1")
    with pytest.raises(RolloutError, match="1 of 4 agent runs failed in step 1"):
        check_error_budget(batch, fraction=0.2, total_errors=1, max_total=None, what="step 1")
    with pytest.raises(RolloutError, match="rollout.max_agent_errors=0"):
        check_error_budget(batch, fraction=1.0, total_errors=1, max_total=0, what="step 1")


def test_close_ends_every_worker_thread() -> None:
    before = set(threading.enumerate())
    runner = RolloutRunner(EchoHolder(delay=0.05), one_call_agent, concurrency=4, defaults=DEFAULTS)
    pending = runner.submit(1, requests_for(40))
    time.sleep(0.02)
    runner.close()
    assert set(threading.enumerate()) == before
    assert pending.done()  # queued runs were cancelled, running ones finished


def test_run_results_round_trip_through_json() -> None:
    runner = RolloutRunner(EchoHolder(), one_call_agent, concurrency=2, defaults=DEFAULTS)
    try:
        batch = runner.submit(3, requests_for(3, group_size=2)).result()
    finally:
        runner.close()
    assert RolloutBatch.from_json(json.loads(json.dumps(batch.to_json()))) == batch
    assert isinstance(batch.runs[0], RunResult)


def test_progress_bar_only_on_a_terminal_outside_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    from nexrl_core.run.metrics import step_line, use_progress_bar

    class Terminal:
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("CI", raising=False)
    assert use_progress_bar(Terminal()) is True  # type: ignore[arg-type]
    monkeypatch.setenv("CI", "true")
    assert use_progress_bar(Terminal()) is False  # type: ignore[arg-type]
    line = step_line({"step": 3, "reward/mean": 0.5, "val/reward/mean": 0.25, "val/count": 8.0, "time/step_s": 2.0}, 10, 14.0)
    assert line == "step 3/10  reward 0.500  val 0.250 (n=8)  2.00s/step  ETA 0:00:14"
