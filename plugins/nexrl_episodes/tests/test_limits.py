"""The recipe's ``rollout.max_prompt_tokens`` (with ``rollout.prompt_overflow``) and
``rollout.max_response_tokens`` on an episode's OpenAI endpoint: the same limits, at the
same boundaries, as the ``threads`` source (both plan calls with
`nexrl_core.run.limits.TurnLimits`)."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from nexrl_core.config.schema import PromptOverflow, RolloutConfig
from nexrl_core.run.rollout import RolloutError
from nexrl_episodes import EpisodeClient
from nexrl_testing.chat_models import RecordingChatModel

QUESTION = [{"role": "user", "content": "1+7="}]
LONGER = [{"role": "user", "content": "11+7="}]
"""One token more than `QUESTION` (the tiny model's digits are a token each)."""


@pytest.fixture
def limited(make_served: Any, chat_model: Any) -> Any:
    """Builds an episode server whose recipe has the given ``rollout`` section, over a `RecordingChatModel`."""

    def make(rollout: RolloutConfig) -> tuple[Any, RecordingChatModel]:
        model = RecordingChatModel(chat_model)
        return make_served(model=model, rollout=rollout), model

    return make


@pytest.mark.parametrize("overflow", list(PromptOverflow), ids=lambda overflow: overflow.value)
def test_a_prompt_of_the_limit_passes_and_one_token_more_does_not(limited: Any, chat_model: Any, overflow: PromptOverflow) -> None:
    limit = len(chat_model.apply_chat_template(QUESTION, tokenize=True))
    longer = chat_model.apply_chat_template(LONGER, tokenize=True)
    assert len(longer) == limit + 1
    served, model = limited(RolloutConfig(max_prompt_tokens=limit, prompt_overflow=overflow))
    futures = served.register(2)
    with EpisodeClient(served.url) as client:
        fits = client.claim(timeout_s=5)
        assert fits.openai.chat.completions.create(model=fits.model, messages=QUESTION).usage.prompt_tokens == limit
        fits.end(1.0)
        over = client.claim(timeout_s=5)
        if overflow is PromptOverflow.TRUNCATE_LEFT:
            reply = over.openai.chat.completions.create(model=over.model, messages=LONGER)
            assert reply.usage.prompt_tokens == limit
            over.end(0.5)
        else:
            with pytest.raises(
                openai.BadRequestError, match=rf"rollout.max_prompt_tokens: .*{limit + 1} tokens, over the limit of {limit}"
            ):
                over.openai.chat.completions.create(model=over.model, messages=LONGER)
    assert futures[0].result(timeout=5).reward == 1.0
    assert [prompt for prompt, _ in model.sampled][0] == chat_model.apply_chat_template(QUESTION, tokenize=True)
    if overflow is PromptOverflow.ERROR:
        with pytest.raises(
            RolloutError, match=r"^rollout.max_prompt_tokens: the prompt of model call 1 of task 't1' \(step 1, run 0\), episode"
        ):
            futures[1].result(timeout=5)
        assert served.store.counts() == {"ended": 1, "failed": 1} and len(model.sampled) == 1
    elif overflow is PromptOverflow.SKIP:
        skipped = futures[1].result(timeout=5)
        assert skipped.skipped is not None and not skipped.failed and skipped.trajectories == []
        assert served.store.counts() == {"ended": 1, "skipped": 1} and len(model.sampled) == 1
    else:
        assert model.sampled[1][0] == longer[1:]  # the last tokens: the generation prompt survives
        assert futures[1].result(timeout=5).trajectories[0].tokens[:limit] == longer[1:]


@pytest.mark.parametrize("budget", [2, 3])
def test_an_episodes_turns_share_one_response_budget(limited: Any, budget: int) -> None:
    """Two one-token turns of one conversation spend a budget of 2: the third turn is
    answered at once, empty, with finish reason length; a budget of 3 leaves it one token."""
    served, model = limited(RolloutConfig(max_tokens=8, max_response_tokens=budget))
    futures = served.register(1)
    with EpisodeClient(served.url) as client:
        episode = client.claim(timeout_s=5)
        messages = list(QUESTION)
        replies = []
        for max_tokens in (1, 1, None):
            reply = episode.openai.chat.completions.create(model=episode.model, messages=messages, max_tokens=max_tokens)
            replies.append(reply)
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
        episode.end(1.0)
    result = futures[0].result(timeout=5)
    assert [options.max_tokens for _, options in model.sampled] == [1, 1, 1][:budget]
    assert [reply.usage.completion_tokens for reply in replies][:2] == [1, 1]
    if budget == 2:
        last = replies[2].choices[0]
        assert (last.finish_reason, last.message.content, replies[2].usage.completion_tokens) == ("length", "", 0)
    assert result.num_calls == budget and [sum(t.loss_mask) for t in result.trajectories] == [budget]
