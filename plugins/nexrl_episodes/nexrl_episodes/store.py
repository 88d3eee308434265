"""Episode state in SQL through SQLAlchemy: SQLite by default, any SQLAlchemy URL otherwise.

One row per episode, keyed by a random id and, uniquely, by the run request it serves
(``train:<step>:<item>:<run>:<seed>``), so a resumed run finds the episodes that already
ended and does not roll them out again. An ended episode's row holds everything
training needs (reward, metrics, every model call's tokens and logprobs), written in
the same transaction that marks it ended: `end` commits before the server acknowledges.

Every method is one short transaction; the caller (`EpisodeBook`) serialises writers.
Writes are Core statements compiled once per dialect (`Prepared`) and run on one DBAPI
connection; reads, which only startup, resume and tests make, go through Core as usual.
SQLite runs in WAL mode with ``synchronous=NORMAL``: a commit is in the WAL file, in the
operating system's page cache, before `end` returns, so a ``kill -9`` of the server loses
nothing committed, and a commit costs tens of microseconds because it does not wait for
the disk. What that mode does not survive is the machine losing power (or its kernel
crashing) before the OS writes the WAL out: the last commits can be lost then. Use a
PostgreSQL URL (or ``synchronous=FULL``) where that matters.
"""

from __future__ import annotations

import json
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
    bindparam,
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


class Prepared:
    """A Core statement compiled once for one dialect, run as its SQL string on a DBAPI cursor.

    Building and executing a Core statement costs SQLAlchemy some 200 µs per call (cache
    key, coercions, execution context): ten times the SQLite commit, and most of what an
    ``end_episode`` cost. Compiled once, a write is the driver's ``execute`` and nothing
    else. The price: no bind processing, so values must be what the driver takes as they
    are (str, int, float, bool, None; JSON columns get `json.dumps` text from the caller).
    Literal values in the statement (``status = 'queued'``) stay bound parameters, with
    their values filled in here.
    """

    def __init__(self, statement: Any, dialect: Any, column_keys: Sequence[str] | None = None) -> None:
        compiled = statement.compile(dialect=dialect, column_keys=column_keys)
        self.sql = compiled.string
        self._defaults = dict(compiled.params)
        self._positional = bool(compiled.positional)
        self._slots = [(name, self._defaults[name]) for name in compiled.positiontup or ()]

    def parameters(self, rows: Sequence[dict[str, Any]]) -> list[tuple[Any, ...]] | list[dict[str, Any]]:
        """The driver's parameters of each of ``rows``: its values (by bound name) over the
        statement's literals, every row in the one style the statement binds by (positional
        or named), as ``executemany`` takes them."""
        if self._positional:
            return [tuple([values[name] if name in values else default for name, default in self._slots]) for values in rows]
        return [{**self._defaults, **values} for values in rows]


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
        self._writer = self.engine.raw_connection()
        """One DBAPI connection for every write: the book serialises writers, and a pool
        checkout per commit would cost as much as the commit itself."""
        self._statements = _write_statements(self.engine.dialect)

    def close(self) -> None:
        self._writer.close()
        self.engine.dispose()

    def _write(self, name: str, values: dict[str, Any]) -> int:
        """Run statement ``name`` in a transaction of its own, committed on return; the rows it touched."""
        return self._transaction([(name, [values])])

    def _transaction(self, batches: Sequence[tuple[str, Sequence[dict[str, Any]]]]) -> int:
        """Run each statement once per row of its batch in one transaction, committed on return;
        the rows the last batch touched."""
        cursor = self._writer.cursor()
        touched = 0
        try:
            for name, rows in batches:
                if not rows:
                    continue
                statement = self._statements[name]
                parameters = statement.parameters(rows)
                if len(rows) == 1:
                    cursor.execute(statement.sql, parameters[0])
                else:
                    cursor.executemany(statement.sql, parameters)
                touched = cursor.rowcount
            self._writer.commit()
        except BaseException:
            self._writer.rollback()
            raise
        finally:
            cursor.close()
        return int(touched or 0)

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
        rows = [
            {
                **attrs.asdict(episode),
                "item": json.dumps(episode.item),
                "sampling": json.dumps(episode.sampling),
                "status": "queued",
                "attempt": 0,
                "end_calls": 0,
                "created_at": now,
            }
            for episode in new
        ]
        again = [{"b_episode_id": episode_id, "b_attempt": attempt, "b_version": version} for episode_id, attempt, version in requeue]
        self._transaction([("add", rows), ("queue_again", again)])

    def requeue(self, episode_id: str, attempt: int) -> None:
        self._write("requeue", {"b_episode_id": episode_id, "b_attempt": attempt})

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
        row = {
            "b_episode_id": episode_id,
            "b_attempt": attempt,
            "b_reward": reward,
            "b_metrics": json.dumps(metrics),
            "b_calls": json.dumps(calls),
            "b_now": now,
            "b_client_id": client_id,
        }
        return self._write("end", row) == 1

    def count_duplicate_end(self, episode_id: str) -> None:
        self._write("count_duplicate_end", {"b_episode_id": episode_id})

    def finish(self, episode_id: str, status: str, error: str) -> None:
        """Mark an episode ``failed`` or ``dropped`` with why."""
        self._write("finish", {"b_episode_id": episode_id, "b_status": status, "b_error": error, "b_now": time.time()})

    def drop_unfinished(self) -> int:
        """Mark every queued or claimed episode ``dropped`` (a new server owns none of them); returns how many."""
        return self._write("drop_unfinished", {})

    def counts(self) -> dict[str, int]:
        """Episodes by status (for tests and status pages)."""
        from sqlalchemy import func

        with self.engine.connect() as conn:
            rows = conn.execute(select(episodes.c.status, func.count()).group_by(episodes.c.status)).all()
            return {status: int(count) for status, count in rows}


def _write_statements(dialect: Any) -> dict[str, Prepared]:
    """Every write the store makes, compiled for ``dialect``. Parameters are named ``b_*`` (a
    column's own name is SQLAlchemy's for its SET clause), except the insert's: its columns."""
    by_id = episodes.c.episode_id == bindparam("b_episode_id")
    # Not IN (...): SQLAlchemy renders that list only at execution time.
    open_statuses = (episodes.c.status == "queued") | (episodes.c.status == "claimed")
    statements = {
        "queue_again": update(episodes)
        .where(by_id)
        .values(status="queued", attempt=bindparam("b_attempt"), policy_version=bindparam("b_version"), client_id=None),
        "requeue": update(episodes).where(by_id).values(status="queued", attempt=bindparam("b_attempt"), client_id=None),
        "end": update(episodes)
        .where(by_id & open_statuses & (episodes.c.attempt == bindparam("b_attempt")))
        .values(
            status="ended",
            reward=bindparam("b_reward"),
            metrics=bindparam("b_metrics"),
            calls=bindparam("b_calls"),
            ended_at=bindparam("b_now"),
            end_calls=1,
            client_id=bindparam("b_client_id"),
        ),
        "count_duplicate_end": update(episodes).where(by_id).values(end_calls=episodes.c.end_calls + 1),
        "finish": update(episodes)
        .where(by_id)
        .values(status=bindparam("b_status"), error=bindparam("b_error"), ended_at=bindparam("b_now")),
        "drop_unfinished": update(episodes)
        .where(open_statuses)
        .values(status="dropped", error="the server that queued it stopped before it ended"),
    }
    prepared = {name: Prepared(statement, dialect) for name, statement in statements.items()}
    added = [*attrs.fields_dict(NewEpisode), "status", "attempt", "end_calls", "created_at"]
    prepared["add"] = Prepared(insert(episodes), dialect, column_keys=added)
    return prepared
