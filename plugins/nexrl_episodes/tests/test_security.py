"""An episode's key opens only its own episode, only while it is claimed; bad requests get a 4xx with a reason."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from nexrl_episodes import EpisodeClient

CHAT = {"model": "m", "messages": [{"role": "user", "content": "1+2="}]}


@pytest.fixture
def two_episodes(served: Any) -> tuple[Any, Any, Any]:
    served.register(2)
    client = EpisodeClient(served.url)
    first, second = client.claim(timeout_s=5), client.claim(timeout_s=5)
    yield served, first, second
    client.close()


def chat_url(episode: Any) -> str:
    return f"{episode.base_url}/chat/completions"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_a_key_works_for_its_own_episode_only(two_episodes: Any) -> None:
    _, first, second = two_episodes
    assert httpx.post(chat_url(first), json=CHAT, headers=auth(first.api_key)).status_code == 200
    refused = httpx.post(chat_url(second), json=CHAT, headers=auth(first.api_key))
    assert refused.status_code == 403
    assert f"belongs to episode {first.episode_id}" in refused.json()["error"]["message"]
    wrong_end = httpx.post(
        f"{first.client.base_url}/end_episode", json={"episode_id": second.episode_id, "reward": 1}, headers=auth(first.api_key)
    )
    assert wrong_end.status_code == 403


def test_a_key_stops_working_when_its_episode_ends(two_episodes: Any) -> None:
    _, first, _ = two_episodes
    first.end(1.0)
    refused = httpx.post(chat_url(first), json=CHAT, headers=auth(first.api_key))
    assert refused.status_code == 409 and "no longer works" in refused.json()["error"]["message"]


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        ({}, "missing episode key"),
        ({"Authorization": "Basic abc"}, "missing episode key"),
        (auth("sk-something"), "not an episode key"),
        (auth("nxe-abc-0"), "malformed episode key"),
    ],
)
def test_requests_without_a_valid_key_are_401(two_episodes: Any, headers: dict[str, str], reason: str) -> None:
    _, first, _ = two_episodes
    for url in (chat_url(first), f"{first.base_url}/completions", f"{first.client.base_url}/end_episode"):
        answer = httpx.post(url, json={**CHAT, "episode_id": first.episode_id, "reward": 1}, headers=headers)
        assert answer.status_code == 401, url
        assert reason in answer.json()["error"]["message"]


def test_a_forged_key_is_401(two_episodes: Any) -> None:
    _, first, _ = two_episodes
    forged = first.api_key[:-4] + ("0000" if not first.api_key.endswith("0000") else "1111")
    answer = httpx.post(chat_url(first), json=CHAT, headers=auth(forged))
    assert answer.status_code == 401 and "bad signature" in answer.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b"{}", "messages (a list of objects) is required"),
        (b'{"messages": "hi"}', "messages must be a list of objects"),
        (b'{"messages": []}', "messages must not be empty"),
        (b'{"messages": [{"role": "wizard", "content": "x"}]}', "messages[0].role"),
        (b'{"messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
        (b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', "temperature must be a number"),
        (b'{"messages": [{"role": "user", "content": "x"}], "top_p": 0}', "top_p must be in (0, 1]"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', "max_tokens must be an integer >= 1"),
        (b'{"messages": [{"role": "user", "content": "x"}], "n": 99}', "n must be an integer between 1 and 16"),
        (b'{"messages": [{"role": "user", "content": "x"}], "stop": [1]}', "stop must be a string"),
        (b'{"messages": [{"role": "user", "content": "x"}], "stream": true}', "stream=true is not supported"),
        (b'{"messages": [{"role": "user", "content": "x"}], "tools": "x"}', "tools must be a list of objects"),
        (b'{"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}', "tool_choice"),
        (b'{"messages": [{"role": "user", "content": "x"}], "presence_penalty": 1}', "does not support presence_penalty"),
    ],
)
def test_malformed_chat_bodies_are_4xx_with_a_message(two_episodes: Any, body: bytes, reason: str) -> None:
    _, first, _ = two_episodes
    answer = httpx.post(chat_url(first), content=body, headers={**auth(first.api_key), "Content-Type": "application/json"})
    assert 400 <= answer.status_code < 500
    assert reason in answer.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"prompt": ""}, "prompt must be a non-empty string"),
        ({"prompt": [1, "x"]}, "prompt must be"),
        ({"prompt": "text"}, "cannot tokenise raw text"),
        ({"prompt": [1, 2], "echo": True}, "echo=true"),
        ({"prompt": [1, 2], "logprobs": 5}, "logprobs must be an integer between 0 and 1"),
        ({"prompt": [1, 2], "suffix": "x"}, "does not support suffix"),
    ],
)
def test_malformed_completion_bodies_are_4xx_with_a_message(two_episodes: Any, body: dict, reason: str) -> None:
    _, first, _ = two_episodes
    answer = httpx.post(f"{first.base_url}/completions", json=body, headers=auth(first.api_key))
    assert 400 <= answer.status_code < 500
    assert reason in answer.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "status", "reason"),
    [
        ({"reward": 1.0}, 400, "episode_id"),
        ({"episode_id": "EP"}, 400, "reward (a finite number) is required"),
        ({"episode_id": "EP", "reward": "high"}, 422, "reward must be a finite number"),
        ({"episode_id": "EP", "reward": True}, 422, "reward must be a finite number"),
        ({"episode_id": "EP", "reward": 1.0, "metadata": [1]}, 422, "metadata must be a JSON object"),
    ],
)
def test_malformed_end_bodies_are_4xx_and_change_nothing(two_episodes: Any, body: dict, status: int, reason: str) -> None:
    served, first, _ = two_episodes
    body = {key: first.episode_id if value == "EP" else value for key, value in body.items()}
    answer = httpx.post(f"{first.client.base_url}/end_episode", json=body, headers=auth(first.api_key))
    assert answer.status_code == status and reason in answer.json()["error"]["message"]
    row = served.store.get(first.episode_id)
    assert row["status"] != "ended" and row["reward"] is None and row["end_calls"] == 0


def test_a_server_key_guards_claims(make_served: Any) -> None:
    served = make_served()
    served.server.stop()
    from nexrl_episodes.server import EpisodeServer

    server = EpisodeServer(served.book, None, api_key="sk-team")
    url = server.start()
    try:
        served.register(1)
        assert httpx.post(f"{url}/claim_episode", json={}).status_code == 401
        assert httpx.post(f"{url}/claim_episode", json={}, headers=auth("sk-other")).status_code == 401
        with EpisodeClient(url, api_key="sk-team") as client:
            assert client.claim(timeout_s=5).task == {"a": 0, "b": 7}
    finally:
        server.stop()
