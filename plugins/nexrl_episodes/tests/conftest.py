"""Shared fixtures: one in-process engine on the shipped tiny model per module, and a served episode book."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nexrl_core.chat.model import SamplingOptions
from nexrl_core.config.schema import ModelConfig, RolloutConfig, TrainConfig
from nexrl_core.run.llm_client import SamplingDefaults
from nexrl_core.run.rollout import RunRequest
from nexrl_episodes.plugin import EpisodesOptions
from nexrl_episodes.server import EpisodeServer
from nexrl_episodes.source import open_book
from nexrl_episodes.store import EpisodeStore

DEFAULTS = SamplingDefaults(max_tokens=8, temperature=1.0, top_p=1.0)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The real nexrl-tiny engine as the backend's ChatModel (what the inprocess backend hands rollouts)."""
    from nexrl_engine.inprocess.config import EngineHolderConfig
    from nexrl_engine.inprocess.holder import EngineHolder

    holder = EngineHolder(EngineHolderConfig(model=ModelConfig(name="nexrl-tiny")), tmp_path_factory.mktemp("engine"))
    # Warm up: the first sample pays one-off costs that would otherwise eat a test's short claim timeout.
    holder.sample_from_messages([{"role": "user", "content": "1+1="}], SamplingOptions(max_tokens=2, seed=0))
    yield holder
    holder.close()


def requests_for(count: int, step: int = 1, is_val: bool = False) -> list[RunRequest]:
    return [
        RunRequest(
            step=step,
            item_index=index,
            run_id=0,
            group_id=f"s{step}-p{index}",
            task_id=f"t{index}",
            item={"a": index, "b": 7},
            seed=1000 + index,
            is_val=is_val,
        )
        for index in range(count)
    ]


class Served:
    """A book behind a running server, with its store on disk, opened as a run opens it:
    from the ``episodes`` source's options and the recipe's ``rollout`` section
    (``max_staleness``, and the prompt and response limits in ``rollout``)."""

    def __init__(
        self,
        directory: Path,
        model: Any,
        url: str,
        max_staleness: int = 0,
        rollout: RolloutConfig | None = None,
        **source_options: Any,
    ) -> None:
        self.directory = directory
        self.store = EpisodeStore(url)
        recipe = TrainConfig(rollout=rollout or RolloutConfig(max_staleness=max_staleness))
        self.book = open_book(self.store, EpisodesOptions(**source_options), recipe)
        self.server = EpisodeServer(self.book, model)
        self.url = self.server.start()

    def register(self, count: int, step: int = 1, is_val: bool = False) -> list[Any]:
        """Queue ``count`` episodes; returns the futures of their runs."""
        return self.book.register(requests_for(count, step, is_val), DEFAULTS)

    def close(self) -> None:
        self.book.close()
        self.server.stop()
        self.store.close()


@pytest.fixture
def make_served(tmp_path: Path, chat_model: Any, sql_url: str) -> Iterator[Any]:
    """Builds servers over one database, SQLite then PostgreSQL (a second server is a
    restarted one); all stopped at the end."""
    made: list[Served] = []

    def make(model: Any = None, **options: Any) -> Served:
        """``max_staleness`` (or a whole ``rollout`` section) as the recipe sets it, the rest
        as the source's options; ``model`` replaces the tiny engine (a wrapper around it)."""
        made.append(Served(tmp_path, model or chat_model, sql_url, **options))
        return made[-1]

    yield make
    for served in made:
        served.close()


@pytest.fixture
def served(make_served: Any) -> Served:
    return make_served()
