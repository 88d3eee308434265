"""Housekeeping on a real `ServiceState` (SQLite file, no engine loaded): what a killed
process left pending fails at start-up, stale sessions release what they hold,
checkpoints past their TTL are deleted, named checkpoints outlive their session."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nexrl_service.futures import RESTART_MESSAGE, FutureBook
from nexrl_service.settings import ServerSettings
from nexrl_service.state import ServiceState
from nexrl_service.store import CheckpointRow, ModelRow, SamplerRow, SessionRow


@pytest.fixture
def state(tmp_path: Path) -> Iterator[ServiceState]:
    settings = ServerSettings(name="janitor-test", data_dir=tmp_path, stale_session_s=60.0, janitor_interval_s=3600.0)
    state = ServiceState(settings)
    try:
        yield state
    finally:
        state.close()


def _add_session_with_resources(state: ServiceState, heartbeat: float, expires_at: float | None = None) -> tuple[Path, Path]:
    """A session with one model, an ephemeral sampler and a named checkpoint, each with files."""
    now = time.time()
    state.store.add_session(SessionRow(session_id="s1", owner="o1", created_at=now, last_heartbeat=heartbeat, status="active"))
    state.store.add_model(
        ModelRow(
            model_id="m1",
            session_id="s1",
            model_seq_id=0,
            owner="o1",
            base_model="nexrl-tiny",
            created_at=now,
            last_request_time=now,
            create_request_id="req-0",
            status="ready",
            last_seq=0,
        )
    )
    snapshot = state.files.ephemeral_dir("m1", "sp1")
    named = state.files.new_checkpoint_dir("m1", "training", "keep")
    for directory in (snapshot, named):
        directory.mkdir(parents=True)
        (directory / "weights.bin").write_bytes(b"0" * 16)
    state.store.add_sampler(
        SamplerRow(
            sampler_id="sp1",
            session_id="s1",
            seq=0,
            owner="o1",
            base_model="nexrl-tiny",
            model_id="m1",
            weights_kind="state",
            weights_dir=str(snapshot),
            ephemeral=True,
            created_at=now,
        )
    )
    state.store.put_checkpoint(
        CheckpointRow(
            path="scheme://m1/weights/keep",
            model_id="m1",
            owner="o1",
            kind="training",
            name="keep",
            storage_dir=str(named),
            created_at=now,
            expires_at=expires_at,
        )
    )
    state.engines.training_or_build("m1", object)  # stands in for a loaded engine
    return snapshot, named


def test_a_stale_session_releases_engines_lanes_and_ephemeral_samplers(state: ServiceState) -> None:
    snapshot, named = _add_session_with_resources(state, heartbeat=time.time() - 120)
    state.scheduler.open_ordered("m1", 1)
    state.janitor.sweep()
    assert state.store.get_session("s1").status == "expired"
    assert state.engines.training("m1") is None and not state.scheduler.has_lane("m1")
    assert state.store.get_sampler("sp1") is None and not snapshot.exists()
    assert state.store.get_checkpoint("scheme://m1/weights/keep") is not None and named.is_dir()
    assert state.store.get_model("m1") is not None


def test_a_live_session_is_left_alone(state: ServiceState) -> None:
    snapshot, _ = _add_session_with_resources(state, heartbeat=time.time())
    state.janitor.sweep()
    assert state.store.get_session("s1").status == "active"
    assert state.engines.training("m1") is not None and snapshot.is_dir()


def test_checkpoints_past_their_ttl_are_deleted_with_their_files(state: ServiceState) -> None:
    _, named = _add_session_with_resources(state, heartbeat=time.time(), expires_at=time.time() - 1)
    state.janitor.sweep()
    assert state.store.get_checkpoint("scheme://m1/weights/keep") is None
    assert not named.exists()


def test_start_fails_what_a_killed_process_left_pending(state: ServiceState) -> None:
    killed = FutureBook(state.store)  # the previous process, on the same database
    left, _ = killed.create("o1", "m1", 3, "Test")
    state.janitor.start()  # what ServiceState.start does after loading the engine stack
    try:
        failed = state.store.get_future(left.request_id)
        assert (failed.status, failed.error, failed.category) == ("failed", RESTART_MESSAGE, "server")
    finally:
        state.janitor.stop()


def test_files_outside_the_data_directory_are_never_deleted(state: ServiceState, tmp_path_factory) -> None:
    outside = tmp_path_factory.mktemp("outside")
    (outside / "precious").write_text("x")
    state.files.remove(outside)
    assert (outside / "precious").is_file()
