"""The episode server fuzzed through its own OpenAPI schema (its hand-read bodies
described there), and as a stateful sequence: episodes registered, one claimed, every
route fuzzed with its id and key, the episode ended, and the server still hands out work.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from nexrl_core.config.schema import TrainConfig
from nexrl_episodes.plugin import EpisodesOptions
from nexrl_episodes.server import EpisodeServer
from nexrl_episodes.source import open_book
from nexrl_episodes.store import EpisodeStore
from nexrl_testing.fuzz import fuzz_app

from tests.conftest import DEFAULTS, requests_for

pytestmark = pytest.mark.slow

MAX_EXAMPLES = 15
"""Generated requests per operation and mode (valid, schema-breaking)."""
SHORT_WAIT_S = 0.05
"""A generated claim's ``wait_s`` is cut to this: a long wait is allowed, just slow to fuzz."""
HAND_READ = ("/claim_episode", "/end_episode", "/episodes/{episode_id}/v1/chat/completions")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, chat_model: Any) -> Iterator[Any]:
    directory: Path = tmp_path_factory.mktemp("fuzz")
    store = EpisodeStore(f"sqlite:///{directory / 'episodes.db'}")
    book = open_book(store, EpisodesOptions(), TrainConfig())
    served = EpisodeServer(book, chat_model)
    served.start()
    try:
        yield served
    finally:
        book.close()
        served.stop()
        store.close()


def short_waits(case: Any) -> None:
    if isinstance(case.body, dict) and isinstance(case.body.get("wait_s"), (int, float)) and not isinstance(case.body["wait_s"], bool):
        case.body["wait_s"] = min(case.body["wait_s"], SHORT_WAIT_S)


def test_the_schema_describes_the_bodies_routes_read_by_hand(server: Any) -> None:
    schema = server.app.openapi()
    for path in HAND_READ:
        assert "requestBody" in schema["paths"][path]["post"], path


def test_no_request_fails_the_server(server: Any) -> None:
    report = fuzz_app(server.app.openapi(), server.base_url, max_examples=MAX_EXAMPLES, on_case=short_waits)
    print(f"episode server: {report.summary()}")
    assert not report.server_errors, "\n".join(report.server_errors)
    assert not report.hangs, report.hangs


def test_an_episode_claimed_used_and_ended_under_fuzzing(server: Any) -> None:
    runs = server.book.register(requests_for(3), DEFAULTS)
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        claimed = client.post("/claim_episode", json={"client_id": "fuzz"}).json()
        episode_id, key = claimed["episode_id"], claimed["api_key"]
        assert episode_id is not None

        def aim_at_the_episode(case: Any) -> None:
            short_waits(case)
            if "episode_id" in (case.path_parameters or {}):
                case.path_parameters["episode_id"] = episode_id

        report = fuzz_app(
            server.app.openapi(),
            server.base_url,
            headers={"Authorization": f"Bearer {key}"},
            max_examples=MAX_EXAMPLES // 2,
            on_case=aim_at_the_episode,
        )
        print(f"episode server, one claimed episode: {report.summary()}")
        assert not report.server_errors, "\n".join(report.server_errors)
        assert not report.hangs, report.hangs
        client.post("/end_episode", json={"episode_id": episode_id, "reward": 1.0}, headers={"Authorization": f"Bearer {key}"})
        after = client.post("/claim_episode", json={"client_id": "after"}).json()
        assert after["episode_id"] is not None, "the server still hands out the episodes left"
    assert runs
