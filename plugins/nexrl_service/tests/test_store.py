"""The runtime's SQL store on SQLite and on PostgreSQL: what survives a restart, and the
rules (deduplication, sequence floors, replaced checkpoints) the services rely on."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from nexrl_service.store import CheckpointRow, FutureRow, ModelRow, SamplerRow, SessionRow, Store


def _session(session_id: str = "s1", owner: str = "o1", heartbeat: float | None = None) -> SessionRow:
    now = time.time()
    return SessionRow(
        session_id=session_id,
        owner=owner,
        tags=["t"],
        user_metadata={"k": "v"},
        created_at=now,
        last_heartbeat=heartbeat if heartbeat is not None else now,
        status="active",
    )


def _model(model_id: str = "m1", session_id: str = "s1", owner: str = "o1") -> ModelRow:
    now = time.time()
    return ModelRow(
        model_id=model_id,
        session_id=session_id,
        model_seq_id=0,
        owner=owner,
        base_model="nexrl-tiny",
        lora_rank=4,
        created_at=now,
        last_request_time=now,
        create_request_id="req-create",
        status="ready",
        last_seq=0,
    )


def _future(request_id: str, lane: str = "m1", seq_id: int | None = None, epoch: str = "e1", **values) -> FutureRow:
    return FutureRow(
        request_id=request_id,
        owner="o1",
        lane=lane,
        seq_id=seq_id,
        kind="Test",
        status="pending",
        epoch=epoch,
        created_at=values.pop("created_at", time.time()),
        **values,
    )


def _checkpoint(path: str, storage_dir: str, expires_at: float | None = None) -> CheckpointRow:
    return CheckpointRow(
        path=path,
        model_id="m1",
        owner="o1",
        kind="training",
        name=path.rsplit("/", 1)[-1],
        storage_dir=storage_dir,
        has_optimizer=True,
        created_at=time.time(),
        expires_at=expires_at,
    )


@pytest.fixture
def url(sql_url: str, tmp_path: Path) -> str:
    """A fresh database; on SQLite in a directory that does not exist yet (the store makes it)."""
    return f"sqlite:///{tmp_path / 'nested' / 'state.db'}" if sql_url.startswith("sqlite") else sql_url


def test_rows_survive_a_restart_on_the_same_file(url: str) -> None:
    store = Store(url)
    store.add_session(_session())
    assert store.add_model(_model())
    assert not store.add_model(_model()), "a second insert of the same model id is a resubmission"
    store.add_sampler(
        SamplerRow(
            sampler_id="sp1",
            session_id="s1",
            seq=0,
            owner="o1",
            base_model="nexrl-tiny",
            weights_kind="base",
            ephemeral=False,
            created_at=time.time(),
        )
    )
    store.add_future(_future("req-1", seq_id=1))
    store.finish_future("req-1", content_type="application/json", result=b"{}")
    store.put_checkpoint(_checkpoint("scheme://m1/weights/a", "/data/a"))
    store.close()

    again = Store(url)  # a new process on the same database
    try:
        session = again.get_session("s1")
        assert (session.owner, session.tags, session.user_metadata, session.status) == ("o1", ["t"], {"k": "v"}, "active")
        assert again.get_model("m1").lora_rank == 4
        assert [s.sampler_id for s in again.samplers_of_session("s1")] == ["sp1"]
        future = again.get_future("req-1")
        assert (future.status, future.content_type, future.result) == ("done", "application/json", b"{}")
        assert again.get_checkpoint("scheme://m1/weights/a").storage_dir == "/data/a"
        assert again.lane_last_seq("m1") == 1
    finally:
        again.close()


def test_a_resubmitted_lane_and_seq_returns_the_first_future(url: str) -> None:
    store = Store(url)
    try:
        first = store.add_future(_future("req-1", lane="m1", seq_id=3))
        second = store.add_future(_future("req-2", lane="m1", seq_id=3))
        assert first.request_id == second.request_id == "req-1"
        assert store.add_future(_future("req-3", lane="m2", seq_id=3)).request_id == "req-3"
        assert store.add_future(_future("req-4", lane="m1")).request_id == "req-4", "no seq_id: never deduplicated"
    finally:
        store.close()


def test_pending_futures_of_another_epoch_are_failed(url: str) -> None:
    store = Store(url)
    try:
        store.add_future(_future("old", seq_id=1, epoch="dead-process"))
        store.add_future(_future("mine", seq_id=2, epoch="this-process"))
        assert store.fail_orphaned_futures("this-process", "restarted") == 1
        old, mine = store.get_future("old"), store.get_future("mine")
        assert (old.status, old.error, old.category) == ("failed", "restarted", "server")
        assert mine.status == "pending"
    finally:
        store.close()


def test_pruning_keeps_the_sequence_floor_and_pending_rows(url: str) -> None:
    store = Store(url)
    try:
        store.add_session(_session())
        store.add_model(_model())
        long_ago = time.time() - 3600
        store.add_future(_future("done-7", seq_id=7, created_at=long_ago))
        store.finish_future("done-7", content_type="application/json", result=b"{}")
        store.add_future(_future("pending-8", seq_id=8, created_at=long_ago))
        removed = store.prune_futures(fetched_before=time.time(), created_before=time.time() - 60)
        assert removed == 1
        assert store.get_future("done-7") is None and store.get_future("pending-8") is not None
        assert store.get_model("m1").last_seq == 8
        assert store.lane_last_seq("m1") == 8
    finally:
        store.close()


def test_checkpoints_replace_and_expire(url: str) -> None:
    store = Store(url)
    try:
        store.add_session(_session())
        store.add_model(_model())
        assert store.put_checkpoint(_checkpoint("scheme://m1/weights/a", "/data/a1")) is None
        replaced = store.put_checkpoint(_checkpoint("scheme://m1/weights/a", "/data/a2"))
        assert replaced is not None and replaced.storage_dir == "/data/a1"
        store.put_checkpoint(_checkpoint("scheme://m1/weights/old", "/data/old", expires_at=time.time() - 1))
        assert [c.path for c in store.expired_checkpoints(time.time())] == ["scheme://m1/weights/old"]
        assert store.delete_checkpoint("scheme://m1/weights/old").storage_dir == "/data/old"
        assert [c.storage_dir for c in store.checkpoints_of_model("m1")] == ["/data/a2"]
    finally:
        store.close()


def test_a_database_from_before_the_newer_columns_gets_them(url: str) -> None:
    """A data directory an older release made (no ``checkpoints.public``, no ``copied_by``,
    no ``samplers.inflight``) opens, its checkpoints read as private and not copied and its
    samplers as snapshots."""
    from sqlalchemy import create_engine, text

    store = Store(url)
    try:
        store.add_session(_session())
        store.add_model(_model())
        store.put_checkpoint(_checkpoint("scheme://m1/weights/a", "/data/a"))
        store.add_sampler(
            SamplerRow(sampler_id="sp1", session_id="s1", seq=0, owner="o1", base_model="nexrl-tiny", weights_kind="base", created_at=0.0)
        )
    finally:
        store.close()
    engine = create_engine(url)
    with engine.begin() as connection:
        connection.execute(text("DROP INDEX ix_checkpoints_copied_by"))
        connection.execute(text("ALTER TABLE checkpoints DROP COLUMN copied_by"))
        connection.execute(text("ALTER TABLE checkpoints DROP COLUMN public"))
        connection.execute(text("ALTER TABLE samplers DROP COLUMN inflight"))
    engine.dispose()
    store = Store(url)
    try:
        assert store.get_sampler("sp1").inflight is False
        row = store.get_checkpoint("scheme://m1/weights/a")
        assert row is not None and row.public is False and row.copied_by is None
        assert store.update_checkpoint(row.path, public=True, copied_by="k").public is True
        assert store.checkpoint_copied_by("o1", "k").path == row.path
    finally:
        store.close()


def test_stale_sessions_and_the_cache_follow_writes(url: str) -> None:
    store = Store(url)
    try:
        store.add_session(_session("fresh"))
        store.add_session(_session("stale", heartbeat=time.time() - 100))
        assert [s.session_id for s in store.stale_sessions(time.time() - 50)] == ["stale"]
        assert store.get_session("stale").status == "active"  # now cached
        store.set_session_status("stale", "expired")
        assert store.get_session("stale").status == "expired"
        assert store.stale_sessions(time.time() - 50) == []
        store.finish_session("fresh", "success")
        fresh = store.get_session("fresh")
        assert (fresh.status, fresh.finish_reason) == ("finished", "success")
    finally:
        store.close()
