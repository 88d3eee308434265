"""``rollout.max_prompt_tokens``, ``rollout.prompt_overflow`` and ``rollout.max_response_tokens``
on the shipped tiny model, through the ``threads`` source's runner: each limit at its
boundary (N tokens pass, N+1 do not), a multi-turn agent's budget across its turns, and
the one line that stops a run.

The model is nexrl-engine's in-process holder on ``nexrl-tiny``; nexrl-testing's
`RecordingChatModel` passes every call on to it and keeps the prompt and options each
sample was drawn with.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from nexrl_core.config.schema import ModelConfig, PromptOverflow, RolloutConfig
from nexrl_core.run.completions import ChatCompletion
from nexrl_core.run.limits import TurnLimits, context_problems
from nexrl_core.run.llm_client import LLMClient, SamplingDefaults
from nexrl_core.run.rollout import RolloutBatch, RolloutError, RolloutRunner, RunRequest, RunResult, check_error_budget
from nexrl_testing.chat_models import RecordingChatModel

QUESTION = [{"role": "user", "content": "12+7="}]
REQUEST = RunRequest(step=1, item_index=0, run_id=0, group_id="s1-p0", task_id="12+7=", item={"q": QUESTION}, seed=5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from nexrl_engine.inprocess.config import EngineHolderConfig
    from nexrl_engine.inprocess.holder import EngineHolder

    holder = EngineHolder(EngineHolderConfig(model=ModelConfig(name="nexrl-tiny")), tmp_path_factory.mktemp("engine"))
    yield holder
    holder.close()


def ask_once(item: Mapping[str, Any], llm: LLMClient) -> float:
    llm.chat.completions.create(messages=item["q"])
    return 1.0


def run_once(model: Any, rollout: RolloutConfig, agent: Any = ask_once) -> RunResult:
    """One run of ``agent`` on `REQUEST` under ``rollout``'s limits; its `RolloutError` propagates."""
    runner = RolloutRunner(
        model,
        agent,
        concurrency=1,
        defaults=SamplingDefaults(max_tokens=rollout.max_tokens, temperature=1.0),
        limits=TurnLimits.of(rollout),
    )
    try:
        return runner.submit(1, [REQUEST]).result().runs[0]
    finally:
        runner.close()


def prompt_of(tiny: Any, messages: list[dict[str, Any]]) -> list[int]:
    return list(tiny.apply_chat_template(messages, tokenize=True))


# --- the prompt limit ---------------------------------------------------------------------------------


@pytest.mark.parametrize("overflow", list(PromptOverflow), ids=lambda overflow: overflow.value)
def test_a_prompt_of_the_limit_passes_and_one_token_more_does_not(tiny: Any, overflow: PromptOverflow) -> None:
    full = prompt_of(tiny, QUESTION)
    model = RecordingChatModel(tiny)
    passed = run_once(model, RolloutConfig(max_prompt_tokens=len(full), prompt_overflow=overflow))
    assert passed.finished and [prompt for prompt, _ in model.sampled] == [full]

    model = RecordingChatModel(tiny)
    over = RolloutConfig(max_prompt_tokens=len(full) - 1, prompt_overflow=overflow)
    if overflow is PromptOverflow.ERROR:
        with pytest.raises(RolloutError, match=rf"has {len(full)} tokens, over the limit of {len(full) - 1};"):
            run_once(model, over)
        assert model.sampled == []
    elif overflow is PromptOverflow.TRUNCATE_LEFT:
        run = run_once(model, over)
        # the last tokens are kept: the generation prompt survives, the first token goes
        assert run.finished and [prompt for prompt, _ in model.sampled] == [full[1:]]
        assert run.trajectories[0].tokens[: len(full) - 1] == full[1:]
    else:
        run = run_once(model, over)
        assert run.skipped is not None and not run.failed and run.reward is None and run.trajectories == []
        assert model.sampled == []
        batch = RolloutBatch(step=1, runs=[run, passed])
        assert batch.metrics()["rollout/skipped_runs"] == 1.0 and batch.metrics()["rollout/agent_errors"] == 0.0
        check_error_budget(batch, fraction=0.0, total_errors=0, max_total=0, what="step 1")  # skipping is no failure


def test_the_error_is_one_line_naming_the_key_the_limit_the_length_and_the_item(tiny: Any) -> None:
    length = len(prompt_of(tiny, QUESTION))
    with pytest.raises(RolloutError) as caught:
        run_once(tiny, RolloutConfig(max_prompt_tokens=length - 1))
    assert str(caught.value) == (
        f"rollout.max_prompt_tokens: the prompt of model call 1 of task '12+7=' (step 1, run 0) has {length} tokens, "
        f"over the limit of {length - 1}; raise rollout.max_prompt_tokens, or set rollout.prompt_overflow to "
        "truncate_left (keep the last tokens) or skip (drop such runs)"
    )


@pytest.mark.parametrize("overflow", [PromptOverflow.ERROR, PromptOverflow.SKIP], ids=lambda overflow: overflow.value)
def test_an_agent_that_catches_the_refusal_cannot_hide_it(tiny: Any, overflow: PromptOverflow) -> None:
    def stubborn(item: Mapping[str, Any], llm: LLMClient) -> float:
        try:
            llm.chat.completions.create(messages=item["q"])
        except BaseException:  # noqa: BLE001 - what a careless agent does
            return 1.0
        return 0.0

    rollout = RolloutConfig(max_prompt_tokens=len(prompt_of(tiny, QUESTION)) - 1, prompt_overflow=overflow)
    if overflow is PromptOverflow.ERROR:
        with pytest.raises(RolloutError, match="rollout.max_prompt_tokens"):
            run_once(tiny, rollout, stubborn)
    else:
        assert run_once(tiny, rollout, stubborn).skipped is not None


# --- the response budget -------------------------------------------------------------------------------


class ThreeTurns:
    """Two turns of one conversation, then a new conversation: keeps every completion."""

    def __init__(self) -> None:
        self.replies: list[ChatCompletion] = []

    def __call__(self, item: Mapping[str, Any], llm: LLMClient) -> float:
        first = llm.chat.completions.create(messages=item["q"])
        follow_up = [*item["q"], first.choices[0].message.to_dict(), {"role": "user", "content": "again"}]
        second = llm.chat.completions.create(messages=follow_up)
        fresh = llm.chat.completions.create(messages=[{"role": "user", "content": "3+4="}])
        self.replies = [first, second, fresh]
        return 1.0


def turns(tiny: Any, budget: int | None) -> tuple[ThreeTurns, RecordingChatModel, RunResult]:
    agent, model = ThreeTurns(), RecordingChatModel(tiny)
    run = run_once(model, RolloutConfig(max_tokens=8, max_response_tokens=budget), agent)
    return agent, model, run


def test_a_multi_turn_agent_shares_one_budget_across_its_turns(tiny: Any) -> None:
    free, _, unlimited = turns(tiny, None)
    first = len(free.replies[0].nexrl.response_tokens)
    assert 1 < first < 8 and len(unlimited.trajectories) == 2  # the follow-up continues the first conversation

    # exactly spent by the first turn: the follow-up gets no tokens and says length; a new conversation gets the whole budget
    agent, model, run = turns(tiny, first)
    assert agent.replies[0].nexrl.response_tokens == free.replies[0].nexrl.response_tokens
    follow_up = agent.replies[1].choices[0]
    assert (follow_up.finish_reason, follow_up.message.content, agent.replies[1].usage.completion_tokens) == ("length", "", 0)
    assert [options.max_tokens for _, options in model.sampled] == [min(8, first), min(8, first)]
    assert run.num_calls == 2 and [sum(t.loss_mask) for t in run.trajectories][0] == first

    # one token more: the follow-up is sampled with what remains, one token
    agent, model, run = turns(tiny, first + 1)
    assert [options.max_tokens for _, options in model.sampled] == [min(8, first + 1), 1, min(8, first + 1)]
    assert len(agent.replies[1].nexrl.response_tokens) == 1 and run.num_calls == 3
    assert sum(run.trajectories[0].loss_mask) == first + 1

    # one token less: the first turn is cut where a max_tokens cut would end it
    agent, _, run = turns(tiny, first - 1)
    assert agent.replies[0].choices[0].finish_reason == "length"
    assert agent.replies[0].nexrl.response_tokens == free.replies[0].nexrl.response_tokens[: first - 1]
    assert agent.replies[1].choices[0].finish_reason == "length" and agent.replies[1].usage.completion_tokens == 0


def test_a_truncated_turn_starts_a_trajectory_with_a_budget_of_its_own(tiny: Any) -> None:
    """Under ``truncate_left`` a follow-up over the limit loses the start of the
    conversation, so it continues nothing: it is trained as a trajectory of its own."""
    agent = ThreeTurns()
    budget = 3
    first_prompt = len(prompt_of(tiny, QUESTION))
    model = RecordingChatModel(tiny)
    run = run_once(
        model,
        RolloutConfig(
            max_tokens=8,
            max_prompt_tokens=first_prompt + budget,
            prompt_overflow=PromptOverflow.TRUNCATE_LEFT,
            max_response_tokens=budget,
        ),
        agent,
    )
    prompts = [prompt for prompt, _ in model.sampled]
    follow_up = prompt_of(tiny, [*QUESTION, agent.replies[0].choices[0].message.to_dict(), {"role": "user", "content": "again"}])
    assert len(follow_up) > first_prompt + budget and prompts[:2] == [prompt_of(tiny, QUESTION), follow_up[-(first_prompt + budget) :]]
    assert [options.max_tokens for _, options in model.sampled] == [budget, budget, budget]
    assert len(run.trajectories) == 3 and all(sum(t.loss_mask) <= budget for t in run.trajectories)


# --- fitting the model's context --------------------------------------------------------------------------


def test_prompt_and_response_limits_must_fit_the_context_together() -> None:
    fits = RolloutConfig(max_tokens=8, max_prompt_tokens=2040)
    assert context_problems(fits, "nexrl-tiny", 2048, "in its config.json") == []
    assert context_problems(RolloutConfig(max_tokens=8, max_prompt_tokens=2041), "nexrl-tiny", 2048, "in its config.json") == [
        "rollout.max_prompt_tokens: 2041 prompt tokens and rollout.max_tokens: 8 response tokens do not fit the context of "
        "model 'nexrl-tiny' (2048 tokens, in its config.json); lower them to 2048 together, e.g. rollout.max_prompt_tokens=2040"
    ]
