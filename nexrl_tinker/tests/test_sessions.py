"""Sessions: heartbeats, finishing, tenant isolation of listings, stale-session expiry."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from nexrl_tinker.testing import BASE_MODEL, TEST_API_KEY, start_service

HEADERS = {"X-API-Key": TEST_API_KEY}


def test_heartbeat_finish_and_listing(base_url: str) -> None:
    with httpx.Client(base_url=base_url, headers=HEADERS, timeout=30) as client:
        session_id = client.post(
            "/api/v1/create_session", json={"tags": ["t"], "user_metadata": {"who": "me"}, "sdk_version": "raw"}
        ).json()["session_id"]

        def cloud_row() -> httpx.Response:
            return client.get(f"/api/v1/sessions/{session_id}")

        assert cloud_row().json() == {
            "training_run_ids": [],
            "sampler_ids": [],
            "user_metadata": {"who": "me"},
            "display_name": None,
        }
        assert client.post("/api/v1/session_heartbeat", json={"session_id": session_id}).json() == {"type": "session_heartbeat"}
        assert session_id in client.get("/api/v1/sessions").json()["sessions"]
        finished = client.post(f"/api/v1/sessions/{session_id}/finish", json={"reason": {"type": "success"}, "detail": None})
        assert finished.status_code == 200
        # The SDK stops heartbeating on 410.
        assert client.post("/api/v1/session_heartbeat", json={"session_id": session_id}).status_code == 410
    with httpx.Client(base_url=base_url, headers={"X-API-Key": "tml-other-tenant"}, timeout=30) as other:
        assert session_id not in other.get("/api/v1/sessions").json()["sessions"]
        assert other.get(f"/api/v1/sessions/{session_id}").status_code == 403
        assert other.post("/api/v1/session_heartbeat", json={"session_id": session_id}).status_code == 403


def test_training_run_keeps_user_metadata(base_url: str, service_client) -> None:
    training = service_client.create_lora_training_client(
        base_model=BASE_MODEL, rank=4, user_metadata={"renderer_name": "role_colon"}
    ).result(timeout=120)
    run = tinker.RestClient(base_url=base_url).get_training_run(training.model_id).result(timeout=30)
    assert run.user_metadata == {"renderer_name": "role_colon"}
    path = training.save_state("meta").result(timeout=120).path
    resumed = service_client.create_training_client_from_state(path).result(timeout=120)
    again = tinker.RestClient(base_url=base_url).get_training_run(resumed.model_id).result(timeout=30)
    assert again.user_metadata == {"renderer_name": "role_colon"}


def test_a_stale_session_expires_and_its_sampler_answers_the_sdk_not_found(tmp_path: Path) -> None:
    """What an expiry looks like through the SDK (what it releases and keeps, engines,
    lanes, snapshots and named checkpoints, is nexrl_service's tests/test_janitor.py)."""
    service = start_service(tmp_path, stale_session_s=1.0, janitor_interval_s=3600.0)
    try:
        with tinker.ServiceClient(base_url=service.base_url) as client:
            training = client.create_lora_training_client(base_model=BASE_MODEL, rank=4).result(timeout=120)
            sampler = training.save_weights_and_get_sampling_client().result(timeout=120)
            state = service.state
            session_id = client.holder.get_session_id()
            with state.store.tx() as s:  # the client is alive and heartbeating: age the session by hand
                from nexrl_service.store import SessionRow

                s.get(SessionRow, session_id).last_heartbeat = time.time() - 10
            state.janitor.sweep()
            assert state.store.get_session(session_id).status == "expired"
            with pytest.raises(tinker.NotFoundError, match="unknown sampling session"):
                sampler.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2)).result(timeout=60)
    finally:
        service.stop()
