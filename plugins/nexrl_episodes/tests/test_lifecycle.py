"""Stale claims go back to the queue, aborts and attempts, staleness, and a restarted server's memory."""

from __future__ import annotations

import time
from typing import Any

import pytest

from nexrl_episodes import EpisodeClient, EpisodeEndedError, NoEpisodeError


def test_a_silent_claim_goes_back_to_the_queue_and_its_late_end_is_refused(make_served: Any) -> None:
    served = make_served(claim_timeout_s=1.0)  # long enough for the model call right after the claim on a busy machine
    futures = served.register(1)
    with EpisodeClient(served.url) as client:
        stale = client.claim(timeout_s=5)
        stale.openai.chat.completions.create(model=stale.model, messages=[{"role": "user", "content": "1+1="}])
        fresh = client.claim(timeout_s=5)  # waits until the janitor requeues the silent claim
        assert fresh.episode_id == stale.episode_id and fresh.api_key != stale.api_key
        with pytest.raises(EpisodeEndedError, match="earlier claim that went back to the queue"):
            stale.end(1.0)
        assert fresh.end(0.25) is False
    result = futures[0].result(timeout=5)
    assert result.reward == 0.25 and result.num_calls == 0  # the stale claim's call was discarded
    assert served.store.counts() == {"ended": 1}


def test_can_continue_is_false_once_the_claim_is_lost(make_served: Any) -> None:
    served = make_served(claim_timeout_s=0.3)
    served.register(1)
    with EpisodeClient(served.url) as client:
        episode = client.claim(timeout_s=5)
        assert episode.can_continue() is True
        time.sleep(1.5)
        assert episode.can_continue() is False


def test_can_continue_is_false_past_the_allowed_staleness(make_served: Any) -> None:
    served = make_served(max_staleness=1)
    served.register(1)
    with EpisodeClient(served.url) as client:
        episode = client.claim(timeout_s=5)
        served.book.set_policy_version(1)
        assert episode.can_continue() is True
        served.book.set_policy_version(2)
        assert client._post("/can_continue_episode", {}, episode.api_key) == {
            "can_continue": False,
            "reason": "the policy moved 2 updates past this episode's weights, more than rollout.max_staleness=1",
        }


def test_an_episode_that_keeps_failing_fails_its_run_instead_of_waiting_forever(make_served: Any) -> None:
    served = make_served(max_attempts=2)
    futures = served.register(1)
    with EpisodeClient(served.url) as client:
        client.claim(timeout_s=5).abort("crashed")
        client.claim(timeout_s=5).abort("crashed again")
        with pytest.raises(TimeoutError):
            client.claim(timeout_s=0.3)
    result = futures[0].result(timeout=5)
    assert result.failed and "claimed 2 times without ending" in result.error and "crashed again" in result.error
    assert served.store.counts() == {"failed": 1}


def test_a_with_block_that_raises_gives_the_episode_back(served: Any) -> None:
    futures = served.register(1)
    with EpisodeClient(served.url) as client:
        with pytest.raises(ZeroDivisionError):
            with client.episode(timeout_s=5):
                raise ZeroDivisionError
        with client.episode(timeout_s=5) as episode:
            episode.end(1.0)
    assert futures[0].result(timeout=5).reward == 1.0


def test_closing_fails_the_runs_still_waiting(served: Any) -> None:
    futures = served.register(2)
    served.book.close()
    assert all("stopping" in future.result(timeout=1).error for future in futures)
    assert served.store.counts() == {"dropped": 2}


def test_a_restarted_server_reuses_ended_episodes_and_acknowledges_their_repeats(make_served: Any) -> None:
    first = make_served()
    first.register(3)
    with EpisodeClient(first.url) as client:
        ended = client.claim(timeout_s=5)
        ended.openai.chat.completions.create(model=ended.model, messages=[{"role": "user", "content": "0+7="}])
        ended.end(1.0)
        client.claim(timeout_s=5)  # claimed, never ended: the server dies holding it
    first.server.stop()  # the process is gone; nothing closed cleanly

    second = make_served()
    second.store.drop_unfinished()
    futures = second.register(3)
    reused = futures[0].result(timeout=0)
    assert reused.reward == 1.0 and reused.num_calls == 1 and reused.trajectories
    assert [future.done() for future in futures] == [True, False, False]
    with EpisodeClient(second.url) as client:
        assert client.end(ended, 0.0) is True  # a client retrying its end after the restart
        rerun = client.claim(timeout_s=5)
        assert rerun.api_key.split("-")[2] == "1"  # attempt 1: the dead server's key for it no longer works
    assert second.store.get(ended.episode_id)["end_calls"] == 2


def test_a_claim_is_not_stale_while_the_server_answers_its_model_call(make_served: Any) -> None:
    served = make_served(claim_timeout_s=0.2)
    served.register(1)
    with EpisodeClient(served.url) as client:
        episode = client.claim(timeout_s=5)
        live, attempt, _ = served.book.start_call(episode.api_key, episode.episode_id)  # a slow model call
        time.sleep(1.0)
        assert served.book.requeue_stale() == 0 and episode.can_continue()
        served.book.end_call(live)
        time.sleep(0.5)
        assert not episode.can_continue()


def test_sixteen_clients_at_once_end_every_episode_exactly_once(served: Any) -> None:
    """Claims, ends and repeated ends from 16 clients at once: every run gets its own
    reward once, nothing is lost or applied twice."""
    from concurrent.futures import ThreadPoolExecutor

    futures = served.register(64)

    def work(worker: int) -> int:
        done = 0
        with EpisodeClient(served.url) as client:
            while True:
                try:
                    episode = client.claim(timeout_s=0.5)
                except NoEpisodeError:
                    return done
                reward = float(episode.task["a"])
                assert episode.end(reward) is False, "a first end is not a repeat"
                assert client.end(episode, reward + 100.0) is True  # a repeat: acknowledged, ignored
                done += 1

    with ThreadPoolExecutor(16) as pool:
        counts = list(pool.map(work, range(16)))
    assert sum(counts) == 64
    assert [future.result(timeout=10).reward for future in futures] == [float(index) for index in range(64)]
