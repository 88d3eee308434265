"""Claim, chat through the real openai client, end: what the training loop gets back, and what the store keeps."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from nexrl_episodes import EpisodeClient, EpisodeEndedError


def test_an_episode_records_every_model_call_into_its_trajectory(served: Any) -> None:
    futures = served.register(1)
    with EpisodeClient(served.url) as client:
        episode = client.claim(timeout_s=5)
        assert episode.task == {"a": 0, "b": 7}
        first = episode.openai.chat.completions.create(model=episode.model, messages=[{"role": "user", "content": "0+7="}], logprobs=True)
        reply = first.choices[0].message
        second = episode.openai.chat.completions.create(
            model=episode.model,
            messages=[
                {"role": "user", "content": "0+7="},
                {"role": "assistant", "content": reply.content},
                {"role": "user", "content": "again"},
            ],
        )
        assert first.usage.completion_tokens == len(first.choices[0].logprobs.content) > 0
        assert episode.end(0.5, tries=2) is False

    result = futures[0].result(timeout=5)
    assert result.reward == 0.5 and result.metrics == {"tries": 2.0} and result.num_calls == 2
    # the second call continues the first conversation: one trajectory, the new user turn untrained
    [trajectory] = result.trajectories
    trained = [token for token, flag in zip(trajectory.tokens, trajectory.loss_mask) if flag]
    assert len(trained) == first.usage.completion_tokens + second.usage.completion_tokens
    first_logprobs = [entry.logprob for entry in first.choices[0].logprobs.content]
    start = first.usage.prompt_tokens
    assert trajectory.logprobs[start : start + len(first_logprobs)] == pytest.approx(first_logprobs)
    assert served.store.counts() == {"ended": 1}


def test_a_repeated_end_is_acknowledged_and_ignored(served: Any) -> None:
    futures = served.register(1)
    with EpisodeClient(served.url) as client:
        episode = client.claim(timeout_s=5)
        assert client.end(episode, 1.0) is False
        assert client.end(episode, 0.0) is True
        assert client.end(episode, 0.0) is True
    assert futures[0].result(timeout=5).reward == 1.0
    row = served.store.get(episode.episode_id)
    assert row["reward"] == 1.0 and row["end_calls"] == 3


def test_n_samples_each_become_a_recorded_call(served: Any) -> None:
    futures = served.register(1)
    with EpisodeClient(served.url) as client:
        episode = client.claim(timeout_s=5)
        answer = episode.openai.chat.completions.create(
            model=episode.model, messages=[{"role": "user", "content": "3+4="}], n=3, max_tokens=4, stop=["\n"]
        )
        assert [choice.index for choice in answer.choices] == [0, 1, 2]
        episode.end(1.0)
    result = futures[0].result(timeout=5)
    assert result.num_calls == 3
    assert all(sum(t.loss_mask) <= 4 for t in result.trajectories)


def test_completions_take_token_ids_and_record_them(served: Any, chat_model: object) -> None:
    futures = served.register(1)
    prompt = chat_model.apply_chat_template([{"role": "user", "content": "1+1="}], tokenize=True)
    with EpisodeClient(served.url) as client:
        episode = client.claim(timeout_s=5)
        answer = episode.openai.completions.create(model=episode.model, prompt=prompt, max_tokens=3, logprobs=1)
        assert answer.usage.prompt_tokens == len(prompt)
        assert len(answer.choices[0].logprobs.token_logprobs) == answer.usage.completion_tokens
        episode.end(0.0)
    [trajectory] = futures[0].result(timeout=5).trajectories
    assert trajectory.tokens[: len(prompt)] == prompt


def test_same_episode_seeds_give_the_same_samples_as_a_replay(served: Any) -> None:
    """Call i of an episode is seeded from the run's seed, so a requeued episode's rerun samples the same."""
    served.register(1)
    messages = [{"role": "user", "content": "12+30="}]
    with EpisodeClient(served.url) as client:
        episode = client.claim(timeout_s=5)
        before = episode.openai.chat.completions.create(model=episode.model, messages=messages).choices[0].message.content
        episode.abort("replay")
        again = client.claim(timeout_s=5)
        after = again.openai.chat.completions.create(model=again.model, messages=messages).choices[0].message.content
        again.end(0.0)
    assert after == before


def test_the_engine_status_follows_the_run(served: Any) -> None:
    def status() -> str:
        return httpx.get(f"{served.url}/get_engine_status").json()["status"]

    assert status() == "booting"
    served.register(1)
    assert status() == "rolling"
    with EpisodeClient(served.url) as client:
        client.claim(timeout_s=5).end(1.0)
    assert status() == "weight-syncing"
    served.book.close()
    assert status() == "offline"


def test_a_client_is_told_when_nothing_waits(served: Any) -> None:
    with EpisodeClient(served.url) as client:
        with pytest.raises(TimeoutError, match="no episode to claim"):
            client.claim(timeout_s=0.3)


def test_openai_errors_reach_the_openai_client_with_the_reason(served: Any) -> None:
    served.register(1)
    with EpisodeClient(served.url) as client:
        episode = client.claim(timeout_s=5)
        with pytest.raises(openai.BadRequestError, match="does not support frequency_penalty"):
            episode.openai.chat.completions.create(model=episode.model, messages=[{"role": "user", "content": "x"}], frequency_penalty=0.5)
        episode.end(0.0)
        with pytest.raises(openai.ConflictError, match="is ended: its key no longer works"):
            episode.openai.chat.completions.create(model=episode.model, messages=[{"role": "user", "content": "x"}])
        with pytest.raises(EpisodeEndedError):
            episode.abort()
