"""The ``episodes`` source's server options, from `rollout.source.options` to what a client sees."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy

from nexrl_core.config import load_config
from nexrl_core.run.rollout import RunRequest
from nexrl_core.training.backend import RolloutSetup
from nexrl_episodes import EpisodeClient
from nexrl_episodes.plugin import EpisodesOptions
from nexrl_episodes.source import EpisodeSource

HOST = "127.0.0.2"
"""A loopback address other than the default ``host`` (Linux answers on all of 127/8)."""
REQUEST = RunRequest(step=1, item_index=0, run_id=0, group_id="g", task_id="t", item={"a": 1, "b": 2}, seed=1, is_val=False)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))  # free where the default host would listen, so the refusal below is ours
        return int(probe.getsockname()[1])


def test_server_options_shape_what_clients_get(tmp_path: Path, chat_model: Any) -> None:
    """``host`` and ``port`` are where it listens (another loopback address than the
    default's, so nothing answers at the default), ``api_key`` guards claims,
    ``public_url`` is the base URL handed out with each claim, ``db_url`` is where the
    episodes are kept."""
    port, database = _free_port(), tmp_path / "elsewhere" / "episodes.db"
    database.parent.mkdir()
    options = EpisodesOptions(
        host=HOST, port=port, public_url="http://proxy.example:9999", db_url=f"sqlite:///{database}", api_key="sk-claims"
    )
    recipe = load_config(None, ["rollout.source.name=episodes"])
    setup = RolloutSetup(recipe=recipe, options=options, model=chat_model, agent=None, work_dir=tmp_path / "rollout")
    (tmp_path / "rollout").mkdir()
    source = EpisodeSource.open(setup)
    try:
        source.submit(1, [REQUEST])
        url = f"http://{HOST}:{port}"
        with pytest.raises(httpx.ConnectError):
            httpx.post(f"http://127.0.0.1:{port}/claim_episode", json={"client_id": "x", "wait_s": 0})
        assert httpx.post(f"{url}/claim_episode", json={"client_id": "x", "wait_s": 0}).status_code == 401
        episode = EpisodeClient(url, api_key="sk-claims").claim(timeout_s=10)
        assert episode.base_url.startswith("http://proxy.example:9999/")
        assert episode.task == REQUEST.item
        episode.end(1.0)
        with sqlalchemy.create_engine(f"sqlite:///{database}").connect() as connection:
            tables = sqlalchemy.inspect(connection).get_table_names()
            assert tables and not list((tmp_path / "rollout").glob("*.db")), "the episodes live at db_url"
    finally:
        source.close()
