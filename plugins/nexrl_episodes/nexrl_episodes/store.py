"""Episode state in SQL through SQLAlchemy: SQLite by default, any SQLAlchemy URL otherwise.

One row per episode, keyed by a random id and, uniquely, by the run request it serves
(``train:<step>:<item>:<run>:<seed>``), so a resumed run finds the episodes that already
ended and does not roll them out again. An ended episode's row holds everything
training needs (reward, metrics, every model call's tokens and logprobs), written in
the same transaction that marks it ended: `end` commits before the server acknowledges.

Every method is one short transaction on Core statements; the caller (`EpisodeBook`)
serialises writers. SQLite runs in WAL mode with ``synchronous=NORMAL``, so a ``kill -9``
of the server loses nothing committed and a commit costs tens of microseconds.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs
from sqlalchemy import (
    JSON,
    Boolean,
    Column,
    Float,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    event,
    insert,
    select,
    update,
)
from sqlalchemy.engine import Engine, make_url

metadata = MetaData()

episodes = Table(
    "episodes",
    metadata,
    Column("episode_id", String(40), primary_key=True),
    Column("request_key", String(200), unique=True, nullable=False),
    # queued, claimed, ended, failed (out of attempts) or dropped (its run stopped first)
    Column("status", String(12), nullable=False, index=True),
    Column("attempt", Integer, nullable=False, default=0),
    Column("step", Integer, nullable=False),
    Column("item_index", Integer, nullable=False),
    Column("run_id", Integer, nullable=False),
    Column("group_id", String(200), nullable=False),
    Column("task_id", String(200), nullable=False),
    Column("is_val", Boolean, nullable=False),
    Column("seed", Integer, nullable=False),
    Column("item", JSON, nullable=False),
    Column("sampling", JSON, nullable=False),
    Column("policy_version", Integer, nullable=False),
    Column("client_id", String(200), nullable=True),
    Column("created_at", Float, nullable=False),
    Column("ended_at", Float, nullable=True),
    Column("reward", Float, nullable=True),
    Column("metrics", JSON, nullable=True),
    Column("calls", JSON, nullable=True),
    Column("error", Text, nullable=True),
    # end_episode calls that reached the episode: 1 + the duplicates that were ignored
    Column("end_calls", Integer, nullable=False, default=0),
)

secrets_table = Table(
    "server_secret",
    metadata,
    Column("name", String(32), primary_key=True),
    Column("value", LargeBinary, nullable=False),
)


@attrs.frozen(kw_only=True)
class NewEpisode:
    """An episode to queue for one run request."""

    episode_id: str
    request_key: str
    step: int
    item_index: int
    run_id: int
    group_id: str
    task_id: str
    is_val: bool
    seed: int
    item: dict[str, Any]
    sampling: dict[str, Any]
    policy_version: int


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.close()


def default_url(directory: Path) -> str:
    return f"sqlite:///{Path(directory) / 'episodes.db'}"


class EpisodeStore:
    """The ``episodes`` table and the server's signing secret."""

    def __init__(self, url: str) -> None:
        self.url = url
        parsed = make_url(url)
        if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        kwargs: dict[str, Any] = {}
        if parsed.get_backend_name() == "sqlite":
            kwargs["connect_args"] = {"check_same_thread": False}
        try:
            self.engine: Engine = create_engine(url, **kwargs)
        except Exception as error:  # a bad URL or a missing driver: say which option to fix
            raise ValueError(f"rollout.source.options.db_url: cannot open {url!r}: {error}") from None
        if parsed.get_backend_name() == "sqlite":
            event.listen(self.engine, "connect", _sqlite_pragmas)
        metadata.create_all(self.engine)
        self._writer = self.engine.connect()
        """One connection for every write: the book serialises writers, and a pool checkout
        per commit would cost as much as the commit itself."""

    def close(self) -> None:
        self._writer.close()
        self.engine.dispose()

    def _write(self) -> Any:
        return self._writer.begin()

    # --- the secret keys are signed with, kept so keys survive a server restart

    def secret(self, make: bytes) -> bytes:
        """The stored secret, or ``make`` stored as it."""
        with self.engine.begin() as conn:
            row = conn.execute(select(secrets_table.c.value).where(secrets_table.c.name == "episode_keys")).first()
            if row is not None:
                return bytes(row[0])
            conn.execute(insert(secrets_table).values(name="episode_keys", value=make))
            return make

    # --- episodes

    def find(self, request_keys: Sequence[str]) -> dict[str, dict[str, Any]]:
        """Rows of the given request keys, by key."""
        if not request_keys:
            return {}
        with self.engine.connect() as conn:
            rows = conn.execute(select(episodes).where(episodes.c.request_key.in_(list(request_keys)))).mappings()
            return {row["request_key"]: dict(row) for row in rows}

    def get(self, episode_id: str) -> dict[str, Any] | None:
        with self.engine.connect() as conn:
            row = conn.execute(select(episodes).where(episodes.c.episode_id == episode_id)).mappings().first()
            return dict(row) if row is not None else None

    def add(self, new: Iterable[NewEpisode], requeue: Iterable[tuple[str, int, int]]) -> None:
        """Queue new episodes and put old ones (id, new attempt, policy version) back in the queue, in one transaction."""
        now = time.time()
        values = [{**attrs.asdict(episode), "status": "queued", "attempt": 0, "created_at": now} for episode in new]
        with self._write():
            conn = self._writer
            if values:
                conn.execute(insert(episodes), values)
            for episode_id, attempt, version in requeue:
                conn.execute(
                    update(episodes)
                    .where(episodes.c.episode_id == episode_id)
                    .values(status="queued", attempt=attempt, policy_version=version, client_id=None)
                )

    def requeue(self, episode_id: str, attempt: int) -> None:
        with self._write():
            conn = self._writer
            conn.execute(
                update(episodes)
                .where(episodes.c.episode_id == episode_id)
                .values(status="queued", attempt=attempt, client_id=None)
            )

    def end(
        self,
        episode_id: str,
        attempt: int,
        reward: float,
        metrics: dict[str, float],
        calls: list[dict[str, Any]],
        now: float,
        client_id: str | None = None,
    ) -> bool:
        """Mark an episode ended with its result; False when it already ended or moved past ``attempt``.

        Claims are not stored (the book holds them), so the row of a claimed episode still says ``queued``."""
        with self._write():
            conn = self._writer
            result = conn.execute(
                update(episodes)
                .where(
                    (episodes.c.episode_id == episode_id)
                    & (episodes.c.status.in_(("queued", "claimed")))
                    & (episodes.c.attempt == attempt)
                )
                .values(
                    status="ended", reward=reward, metrics=metrics, calls=calls, ended_at=now, end_calls=1,
                    client_id=client_id,
                )
            )
            return result.rowcount == 1

    def count_duplicate_end(self, episode_id: str) -> None:
        with self._write():
            conn = self._writer
            conn.execute(
                update(episodes).where(episodes.c.episode_id == episode_id).values(end_calls=episodes.c.end_calls + 1)
            )

    def finish(self, episode_id: str, status: str, error: str) -> None:
        """Mark an episode ``failed`` or ``dropped`` with why."""
        with self._write():
            conn = self._writer
            conn.execute(
                update(episodes)
                .where(episodes.c.episode_id == episode_id)
                .values(status=status, error=error, ended_at=time.time())
            )

    def drop_unfinished(self) -> int:
        """Mark every queued or claimed episode ``dropped`` (a new server owns none of them); returns how many."""
        with self._write():
            conn = self._writer
            result = conn.execute(
                update(episodes)
                .where(episodes.c.status.in_(["queued", "claimed"]))
                .values(status="dropped", error="the server that queued it stopped before it ended")
            )
            return int(result.rowcount or 0)

    def counts(self) -> dict[str, int]:
        """Episodes by status (for tests and status pages)."""
        from sqlalchemy import func

        with self.engine.connect() as conn:
            rows = conn.execute(select(episodes.c.status, func.count()).group_by(episodes.c.status)).all()
            return {status: int(count) for status, count in rows}
