"""Everything a local service must remember across a restart, in SQL through SQLAlchemy 2.

Six tables: sessions, models (training runs), samplers (sampling sessions), futures
(what some protocols call operations), checkpoints, and the restarts of models' worker
groups. Ids and checkpoint paths are
the protocol's own strings; the store only keys rows by them.
SQLite by default (WAL journal, ``synchronous=NORMAL``: a ``kill -9`` of the server
loses nothing that was committed, and a commit costs well under a millisecond), any
SQLAlchemy URL otherwise (PostgreSQL in a multi-host deployment).

Times are stored as float Unix seconds: portable across back ends, no timezone traps.
Rows are returned detached (``expire_on_commit=False``) and treated as read-only
snapshots by callers; every change goes through a `Store` method that opens its own
short transaction, so the store can be used from the event loop and from worker
threads alike.

Sessions, models and samplers are read on every request (ownership checks), so the
store keeps a write-through cache of them: this process is the only writer, and every
write through the store drops the cached row. Futures are written with Core
statements built once (a sixth of the ORM's cost): one small transaction when a
request is accepted and one when it finishes, or one for every request of a batch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, cast

from sqlalchemy import (
    JSON,
    Boolean,
    ClauseElement,
    CursorResult,
    DefaultClause,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Table,
    Text,
    bindparam,
    create_engine,
    delete,
    event,
    false,
    func,
    insert,
    inspect,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.engine import Engine as SqlEngine
from sqlalchemy.engine import Result, make_url
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker
from sqlalchemy.pool import StaticPool

__all__ = [
    "COPY_STATUS",
    "CheckpointRow",
    "FutureRow",
    "ModelRow",
    "RestartRow",
    "SamplerRow",
    "SessionRow",
    "Store",
]


COPY_STATUS = "copy"
"""The status of a training run made to hold a copy of a checkpoint: it cannot be trained on."""


class Base(DeclarativeBase):
    """The runtime's tables: one metadata, created by `Store`."""


def _table(model: type[Base]) -> Table:
    """``model``'s `Table`, which inserts and updates take: SQLAlchemy types ``__table__`` as
    any `FromClause` (a class may be mapped to a subquery), and every model here names a table."""
    return cast(Table, model.__table__)


def _rows_touched(result: Result[Any]) -> int:
    """How many rows an UPDATE or DELETE touched: its result is a `CursorResult`, which has
    the rowcount, though `Session.execute` is typed to return any `Result`."""
    return int(cast(CursorResult[Any], result).rowcount or 0)


class SessionRow(Base):
    """A client's session; ``owner`` is the hash of the API key that created it."""

    __tablename__ = "sessions"

    session_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str] = mapped_column(String(64), index=True)
    sdk_version: Mapped[str | None] = mapped_column(String(64), nullable=True)
    tags: Mapped[list[str]] = mapped_column(JSON, default=list)
    user_metadata: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    display_name: Mapped[str | None] = mapped_column(String(256), nullable=True)
    project_id: Mapped[str | None] = mapped_column(String(256), nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    last_heartbeat: Mapped[float] = mapped_column(Float, index=True)
    status: Mapped[str] = mapped_column(String(16), default="active")
    """``active``, ``finished`` (client closed it) or ``expired`` (stale, resources released)."""
    finish_reason: Mapped[str | None] = mapped_column(String(32), nullable=True)


class ModelRow(Base):
    """A training model (a training run), numbered ``model_seq_id`` within its session."""

    __tablename__ = "models"

    model_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.session_id"), index=True)
    model_seq_id: Mapped[int] = mapped_column(Integer)
    owner: Mapped[str] = mapped_column(String(64), index=True)
    base_model: Mapped[str] = mapped_column(String(512))
    lora_rank: Mapped[int] = mapped_column(Integer, default=0)
    """0 means full fine-tuning."""
    lora_alpha: Mapped[float] = mapped_column(Float, default=32.0)
    lora_seed: Mapped[int] = mapped_column(Integer, default=0)
    train_mlp: Mapped[bool] = mapped_column(Boolean, default=True)
    train_attn: Mapped[bool] = mapped_column(Boolean, default=True)
    train_unembed: Mapped[bool] = mapped_column(Boolean, default=True)
    user_metadata: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    last_request_time: Mapped[float] = mapped_column(Float)
    create_request_id: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16), default="creating")
    """``creating``, ``ready``, ``failed``, or `COPY_STATUS` for a run that only holds copied weights."""
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    state_dir: Mapped[str | None] = mapped_column(Text, nullable=True)
    """The newest training-state directory of this model (saved or loaded): where a
    restarted server rebuilds the engine from."""
    state_has_optimizer: Mapped[bool] = mapped_column(Boolean, default=False)
    last_seq: Mapped[int] = mapped_column(Integer, default=0)
    """A floor for the highest ``seq_id`` used on this model (refused submissions, and
    futures about to be pruned, move it up); see `Store.lane_last_seq`."""


class SamplerRow(Base):
    """A sampling session, numbered ``seq`` within its session and bound to fixed weights,
    or, ``inflight``, to its training run's newest inflight save."""

    __tablename__ = "samplers"

    sampler_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.session_id"), index=True)
    seq: Mapped[int] = mapped_column(Integer)
    owner: Mapped[str] = mapped_column(String(64), index=True)
    base_model: Mapped[str] = mapped_column(String(512))
    model_path: Mapped[str | None] = mapped_column(Text, nullable=True)
    """The checkpoint path it was created from, None for a base model or an ephemeral save."""
    model_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    """The training run whose weights it serves, if any."""
    weights_kind: Mapped[str] = mapped_column(String(16))
    """``base`` (the served base model), ``hf`` (an exported HF directory) or
    ``state`` (a training-state directory loaded onto the base model)."""
    weights_dir: Mapped[str | None] = mapped_column(Text, nullable=True)
    ephemeral: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[float] = mapped_column(Float)
    inflight: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    """Whether each later inflight save of its training run rebinds it (Tinker's
    ``kind="inflight"``): its weights are the newest inflight save's, never older than its own."""


class FutureRow(Base):
    """One submitted request and, once done, its result or error.

    ``lane`` is the model or sampler it runs on; ``(lane, seq_id)`` is unique, which is
    how a resubmission of the same sequence number gets the same future back.
    ``epoch`` names the server process that accepted it: a pending row from another
    epoch was in flight when that process died.
    """

    __tablename__ = "futures"
    __table_args__ = (Index("ix_futures_lane_seq", "lane", "seq_id", unique=True),)

    request_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str] = mapped_column(String(64))
    lane: Mapped[str] = mapped_column(String(128))
    seq_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    kind: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16), default="pending", index=True)
    """``pending``, ``done`` or ``failed``."""
    epoch: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[float] = mapped_column(Float, index=True)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    fetched_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    content_type: Mapped[str | None] = mapped_column(String(64), nullable=True)
    result: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    category: Mapped[str | None] = mapped_column(String(16), nullable=True)
    extra: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    """Submission details echoed back on a deduplicated resubmission (sequence ids)."""


class CheckpointRow(Base):
    """A named checkpoint of a model: training state or an exported HF directory.

    ``path`` is how clients name it, in the protocol's format (a URI naming the model,
    the kind and the name, e.g. ``scheme://{model_id}/weights/{name}``)."""

    __tablename__ = "checkpoints"

    path: Mapped[str] = mapped_column(String(768), primary_key=True)
    model_id: Mapped[str] = mapped_column(ForeignKey("models.model_id"), index=True)
    owner: Mapped[str] = mapped_column(String(64), index=True)
    kind: Mapped[str] = mapped_column(String(16))
    """``training`` (state to resume from) or ``sampler`` (weights to sample from)."""
    name: Mapped[str] = mapped_column(String(256))
    storage_dir: Mapped[str] = mapped_column(Text)
    has_optimizer: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    size_bytes: Mapped[int | None] = mapped_column(Integer, nullable=True)
    user_metadata: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    public: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    """Published: any API key may read it (sample from it, load it, copy it); only its owner changes it."""
    copied_by: Mapped[str | None] = mapped_column(String(128), nullable=True, index=True)
    """The idempotency key of the copy request that made this checkpoint: a retried copy
    finds it instead of making a second copy."""


class RestartRow(Base):
    """A model's worker group was lost and restarted (`nexrl_core.training.worker_groups`)."""

    __tablename__ = "group_restarts"

    restart_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model_id: Mapped[str] = mapped_column(ForeignKey("models.model_id"), index=True)
    at: Mapped[float] = mapped_column(Float)
    reason: Mapped[str] = mapped_column(Text)
    restored_from: Mapped[str | None] = mapped_column(Text, nullable=True)
    """The restart point loaded; None when the model went back to its initial weights."""
    replayed: Mapped[int] = mapped_column(Integer)
    """Calls since that point run again on the new group."""
    seconds: Mapped[float] = mapped_column(Float)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


_FUTURE_COLUMNS = tuple(column.name for column in FutureRow.__table__.columns)
_INSERT_FUTURE = insert(_table(FutureRow))
_FINISH_FUTURE = (
    update(_table(FutureRow))
    .where(FutureRow.__table__.c.request_id == bindparam("request_id_"))
    .values(
        status=bindparam("status"),
        finished_at=bindparam("finished_at"),
        content_type=bindparam("content_type"),
        result=bindparam("result"),
        error=bindparam("error"),
        category=bindparam("category"),
    )
)
"""The futures' hot-path statements, built once: building one per call (bound values
inside) costs more than running it."""


def add_missing_columns(engine: SqlEngine) -> list[str]:
    """Add the columns a newer release declares to tables an older one created.

    ``create_all`` creates missing tables but never alters existing ones, so a data
    directory from before a column existed would fail on its first query. Every column
    added since the first release is nullable or has a server default, so adding it in
    place is safe on SQLite and PostgreSQL alike. Returns ``table.column`` of each one added.
    """
    inspector = inspect(engine)
    added = []
    with engine.begin() as connection:
        for table in Base.metadata.sorted_tables:
            if not inspector.has_table(table.name):
                continue
            present = {column["name"] for column in inspector.get_columns(table.name)}
            for column in table.columns:
                if column.name in present:
                    continue
                kind = column.type.compile(dialect=engine.dialect)
                default = ""
                if column.server_default is not None:
                    # Every server default here is a SQL expression (``false()``), kept in a `DefaultClause`.
                    assert isinstance(column.server_default, DefaultClause) and isinstance(column.server_default.arg, ClauseElement)
                    default = f" DEFAULT {column.server_default.arg.compile(dialect=engine.dialect)}"
                connection.execute(text(f'ALTER TABLE "{table.name}" ADD COLUMN "{column.name}" {kind}{default}'))
                added.append(f"{table.name}.{column.name}")
    return added


def make_sql_engine(url: str) -> SqlEngine:
    """An SQLAlchemy engine for ``url``; SQLite gets WAL and a parent directory."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True)
    database = parsed.database
    if not database or database == ":memory:":
        engine = create_engine(url, connect_args={"check_same_thread": False}, poolclass=StaticPool)
    else:
        Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
    event.listen(engine, "connect", _sqlite_pragmas)
    return engine


class Store:
    """Typed, transaction-per-call access to the tables."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = make_sql_engine(url)
        Base.metadata.create_all(self.engine)
        add_missing_columns(self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._serial: Any = threading.RLock() if self.engine.dialect.name == "sqlite" else nullcontext()
        """SQLite has one writer at a time, and a writer that finds the database locked
        sleeps in SQLite's busy handler for milliseconds; with a burst of requests on
        many threads that sleeping dominated. This process's transactions take turns
        in Python instead (other processes still meet the busy timeout)."""
        self._cache_lock = threading.Lock()
        self._cache: dict[tuple[type, str], Any] = {}

    def _cached(self, kind: type, key: str) -> Any:
        with self._cache_lock:
            row = self._cache.get((kind, key))
        if row is not None:
            return row
        with self.tx() as s:
            row = s.get(kind, key)
        if row is not None:
            with self._cache_lock:
                self._cache[(kind, key)] = row
        return row

    def _forget(self, kind: type, *keys: str) -> None:
        with self._cache_lock:
            for key in keys:
                self._cache.pop((kind, key), None)

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def tx(self) -> Iterator[Session]:
        """One transaction: committed on success, rolled back on error."""
        with self._serial, self._sessions.begin() as session:
            yield session

    # --- sessions ------------------------------------------------------------------------

    def add_session(self, row: SessionRow) -> None:
        with self.tx() as s:
            s.add(row)

    def get_session(self, session_id: str) -> SessionRow | None:
        return self._cached(SessionRow, session_id)

    def touch_session(self, session_id: str, now: float | None = None) -> None:
        self._forget(SessionRow, session_id)
        with self.tx() as s:
            s.execute(
                update(SessionRow).where(SessionRow.session_id == session_id).values(last_heartbeat=now if now is not None else time.time())
            )

    def finish_session(self, session_id: str, reason: str | None) -> None:
        self._forget(SessionRow, session_id)
        with self.tx() as s:
            s.execute(
                update(SessionRow)
                .where(SessionRow.session_id == session_id)
                .values(status="finished", finish_reason=reason, last_heartbeat=time.time())
            )

    def set_session_status(self, session_id: str, status: str) -> None:
        self._forget(SessionRow, session_id)
        with self.tx() as s:
            s.execute(update(SessionRow).where(SessionRow.session_id == session_id).values(status=status))

    def sessions_of(self, owner: str) -> list[SessionRow]:
        with self.tx() as s:
            return list(s.scalars(select(SessionRow).where(SessionRow.owner == owner).order_by(SessionRow.created_at)))

    def sessions_page(self, owner: str, limit: int, offset: int) -> list[SessionRow]:
        """One page of the owner's sessions, newest first.

        Ordered by creation time and then by id, so pages are stable: a session created
        meanwhile moves later pages by one, never makes one skip or repeat a row by chance.
        """
        with self.tx() as s:
            rows = s.scalars(
                select(SessionRow)
                .where(SessionRow.owner == owner)
                .order_by(SessionRow.created_at.desc(), SessionRow.session_id.desc())
                .limit(limit)
                .offset(offset)
            )
            return list(rows)

    def set_session_project(self, session_id: str, project_id: str) -> None:
        with self.tx() as s:
            s.execute(update(SessionRow).where(SessionRow.session_id == session_id).values(project_id=project_id))
        self._forget(SessionRow, session_id)

    def stale_sessions(self, older_than: float) -> list[SessionRow]:
        """Sessions not yet expired whose last heartbeat is before ``older_than``."""
        with self.tx() as s:
            return list(s.scalars(select(SessionRow).where(SessionRow.last_heartbeat < older_than, SessionRow.status != "expired")))

    # --- models ---------------------------------------------------------------------------

    def add_model(self, row: ModelRow) -> bool:
        """Insert; False if the model id already exists (a resubmission)."""
        try:
            with self.tx() as s:
                s.add(row)
            return True
        except IntegrityError:
            return False

    def get_model(self, model_id: str) -> ModelRow | None:
        return self._cached(ModelRow, model_id)

    def update_model(self, model_id: str, **values: Any) -> None:
        with self.tx() as s:
            s.execute(update(ModelRow).where(ModelRow.model_id == model_id).values(**values))
        self._forget(ModelRow, model_id)

    def models_of_session(self, session_id: str) -> list[ModelRow]:
        with self.tx() as s:
            return list(s.scalars(select(ModelRow).where(ModelRow.session_id == session_id).order_by(ModelRow.model_seq_id)))

    def models_of(self, owner: str) -> list[ModelRow]:
        with self.tx() as s:
            return list(s.scalars(select(ModelRow).where(ModelRow.owner == owner).order_by(ModelRow.created_at)))

    # --- samplers -------------------------------------------------------------------------

    def add_sampler(self, row: SamplerRow) -> None:
        with self.tx() as s:
            s.add(row)

    def get_sampler(self, sampler_id: str) -> SamplerRow | None:
        return self._cached(SamplerRow, sampler_id)

    def sampler_by_seq(self, session_id: str, seq: int) -> SamplerRow | None:
        with self.tx() as s:
            return s.scalars(select(SamplerRow).where(SamplerRow.session_id == session_id, SamplerRow.seq == seq)).first()

    def samplers_of_session(self, session_id: str) -> list[SamplerRow]:
        with self.tx() as s:
            return list(s.scalars(select(SamplerRow).where(SamplerRow.session_id == session_id).order_by(SamplerRow.seq)))

    def ephemeral_samplers_of_model(self, model_id: str) -> list[SamplerRow]:
        with self.tx() as s:
            return list(
                s.scalars(
                    select(SamplerRow)
                    .where(SamplerRow.model_id == model_id, SamplerRow.ephemeral.is_(True))
                    .order_by(SamplerRow.created_at)
                )
            )

    def rebind_inflight_samplers(self, model_id: str, weights_dir: str) -> list[str]:
        """Bind every inflight sampler of ``model_id`` to ``weights_dir``; the directories they left."""
        with self.tx() as s:
            rows = list(s.scalars(select(SamplerRow).where(SamplerRow.model_id == model_id, SamplerRow.inflight.is_(True))))
            left = sorted({row.weights_dir for row in rows if row.weights_dir and row.weights_dir != weights_dir})
            s.execute(
                update(SamplerRow).where(SamplerRow.model_id == model_id, SamplerRow.inflight.is_(True)).values(weights_dir=weights_dir)
            )
        self._forget(SamplerRow, *(row.sampler_id for row in rows))
        return left

    def delete_samplers(self, sampler_ids: Sequence[str]) -> None:
        if not sampler_ids:
            return
        self._forget(SamplerRow, *sampler_ids)
        with self.tx() as s:
            for sampler_id in sampler_ids:
                row = s.get(SamplerRow, sampler_id)
                if row is not None:
                    s.delete(row)

    # --- futures --------------------------------------------------------------------------

    def add_future(self, row: FutureRow) -> FutureRow:
        """Insert, or return the existing row with the same ``(lane, seq_id)`` (the unique
        index decides): one small transaction on the request path."""
        values = {name: getattr(row, name) for name in _FUTURE_COLUMNS}
        try:
            with self.engine.begin() as connection:
                connection.execute(_INSERT_FUTURE, values)
        except IntegrityError:
            existing = self.future_by_seq(row.lane, row.seq_id) if row.seq_id is not None else None
            if existing is None:
                raise
            return existing
        return row

    def lane_last_seq(self, model_id: str) -> int:
        """Highest ``seq_id`` ever used on a model: where its queue resumes after a restart."""
        with self.engine.begin() as connection:
            recorded = connection.execute(select(ModelRow.__table__.c.last_seq).where(ModelRow.__table__.c.model_id == model_id)).scalar()
            submitted = connection.execute(
                select(func.max(FutureRow.__table__.c.seq_id)).where(FutureRow.__table__.c.lane == model_id)
            ).scalar()
        return max(int(recorded or 0), int(submitted or 0))

    def future_by_seq(self, lane: str, seq_id: int) -> FutureRow | None:
        with self.tx() as s:
            return s.scalars(select(FutureRow).where(FutureRow.lane == lane, FutureRow.seq_id == seq_id)).first()

    def get_future(self, request_id: str) -> FutureRow | None:
        with self.tx() as s:
            return s.get(FutureRow, request_id)

    def finish_future(
        self,
        request_id: str,
        *,
        content_type: str | None = None,
        result: bytes | None = None,
        error: str | None = None,
        category: str | None = None,
    ) -> None:
        self.finish_futures([(request_id, content_type, result, error, category)])

    def finish_futures(self, finished: Sequence[tuple[str, str | None, bytes | None, str | None, str | None]]) -> None:
        """Record ``(request_id, content_type, result, error, category)`` outcomes in one
        transaction; an error makes the future ``failed``, else it is ``done``."""
        if not finished:
            return
        now = time.time()
        params = [
            {
                "request_id_": request_id,
                "status": "failed" if error is not None else "done",
                "finished_at": now,
                "content_type": content_type,
                "result": result,
                "error": error,
                "category": category,
            }
            for request_id, content_type, result, error, category in finished
        ]
        with self.engine.begin() as connection:
            connection.execute(_FINISH_FUTURE, params)

    def mark_fetched(self, request_ids: Sequence[str], now: float) -> None:
        if not request_ids:
            return
        with self.tx() as s:
            s.execute(
                update(FutureRow).where(FutureRow.request_id.in_(list(request_ids)), FutureRow.fetched_at.is_(None)).values(fetched_at=now)
            )

    def fail_orphaned_futures(self, epoch: str, message: str) -> int:
        """Fail every pending future accepted by another server process; returns how many."""
        with self.tx() as s:
            result = s.execute(
                update(FutureRow)
                .where(FutureRow.status == "pending", FutureRow.epoch != epoch)
                .values(status="failed", finished_at=time.time(), error=message, category="server")
            )
            return _rows_touched(result)

    def bump_last_seq(self, model_id: str, seq_id: int) -> None:
        """Record that ``seq_id`` was used (a refused submission still consumes its number)."""
        with self.tx() as s:
            s.execute(update(ModelRow).where(ModelRow.model_id == model_id, ModelRow.last_seq < seq_id).values(last_seq=seq_id))
        self._forget(ModelRow, model_id)

    def prune_futures(self, fetched_before: float, created_before: float) -> int:
        """Drop results fetched before ``fetched_before`` and finished ones created before
        ``created_before`` (never fetched); pending rows are kept. Each model's
        ``last_seq`` first absorbs the sequence numbers about to disappear."""
        futures, models = FutureRow.__table__, _table(ModelRow)
        highest = select(func.max(futures.c.seq_id)).where(futures.c.lane == models.c.model_id).scalar_subquery()
        with self.tx() as s:
            s.execute(
                update(models)
                .where(
                    select(futures.c.request_id).where(futures.c.lane == models.c.model_id, futures.c.seq_id > models.c.last_seq).exists()
                )
                .values(last_seq=highest)
            )
            result = s.execute(
                delete(FutureRow).where(
                    FutureRow.status != "pending",
                    or_(FutureRow.fetched_at < fetched_before, FutureRow.created_at < created_before),
                )
            )
        with self._cache_lock:
            self._cache = {key: row for key, row in self._cache.items() if key[0] is not ModelRow}
        return _rows_touched(result)

    # --- checkpoints ----------------------------------------------------------------------

    def put_checkpoint(self, row: CheckpointRow) -> CheckpointRow | None:
        """Insert or replace; returns the replaced row, if any."""
        with self.tx() as s:
            old = s.get(CheckpointRow, row.path)
            previous = None
            if old is not None:
                previous = CheckpointRow(
                    path=old.path,
                    model_id=old.model_id,
                    owner=old.owner,
                    kind=old.kind,
                    name=old.name,
                    storage_dir=old.storage_dir,
                    has_optimizer=old.has_optimizer,
                    created_at=old.created_at,
                    expires_at=old.expires_at,
                    size_bytes=old.size_bytes,
                    user_metadata=old.user_metadata,
                    public=old.public,
                    copied_by=old.copied_by,
                )
                s.delete(old)
                s.flush()
            s.add(row)
            return previous

    def get_checkpoint(self, path: str) -> CheckpointRow | None:
        with self.tx() as s:
            return s.get(CheckpointRow, path)

    def checkpoints_of_model(self, model_id: str) -> list[CheckpointRow]:
        with self.tx() as s:
            return list(s.scalars(select(CheckpointRow).where(CheckpointRow.model_id == model_id).order_by(CheckpointRow.created_at)))

    def update_checkpoint(self, path: str, **values: Any) -> CheckpointRow | None:
        """Change columns of one checkpoint; returns the row as it is now (None if unknown)."""
        with self.tx() as s:
            s.execute(update(CheckpointRow).where(CheckpointRow.path == path).values(**values))
            return s.get(CheckpointRow, path)

    def checkpoint_copied_by(self, owner: str, key: str) -> CheckpointRow | None:
        """The checkpoint an earlier copy request with idempotency key ``key`` made, if any."""
        with self.tx() as s:
            return s.scalars(select(CheckpointRow).where(CheckpointRow.owner == owner, CheckpointRow.copied_by == key)).first()

    def delete_checkpoint(self, path: str) -> CheckpointRow | None:
        with self.tx() as s:
            row = s.get(CheckpointRow, path)
            if row is not None:
                s.delete(row)
            return row

    def expired_checkpoints(self, now: float) -> list[CheckpointRow]:
        with self.tx() as s:
            return list(s.scalars(select(CheckpointRow).where(CheckpointRow.expires_at.is_not(None), CheckpointRow.expires_at < now)))

    def add_restart(self, row: RestartRow) -> None:
        with self.tx() as s:
            s.add(row)

    def restarts_of(self, model_id: str) -> list[RestartRow]:
        with self.tx() as s:
            return list(s.scalars(select(RestartRow).where(RestartRow.model_id == model_id).order_by(RestartRow.restart_id)))
