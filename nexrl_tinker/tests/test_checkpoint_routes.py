"""The RestClient's checkpoint and session management through the unmodified SDK:
publishing, time-to-live, ``copy_weights``, session projects and ``list_sessions``
paging; and the routes this service refuses (hosted telemetry and search), which answer
a 4xx in words, as does any path it has no route for.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import pytest
import tinker

from nexrl_tinker.testing import BASE_MODEL, TEST_API_KEY

OTHER_KEY = "tml-other-tenant"


@pytest.fixture(scope="module")
def rest(base_url: str) -> tinker.RestClient:
    return tinker.RestClient(base_url=base_url, api_key=TEST_API_KEY)


@pytest.fixture(scope="module")
def other(base_url: str):
    client = tinker.ServiceClient(base_url=base_url, api_key=OTHER_KEY)
    try:
        yield client
    finally:
        client.close("success").result(timeout=30)


@pytest.fixture(scope="module")
def training(service_client):
    return service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=3).result(timeout=120)


def listed(rest: tinker.RestClient, run: str) -> dict[str, tinker.types.Checkpoint]:
    return {c.tinker_path: c for c in rest.list_checkpoints(run).result().checkpoints}


def test_publish_lets_another_key_sample_and_unpublish_takes_it_back(training, rest, other, base_url: str) -> None:
    path = training.save_weights_for_sampler("shared").result().path
    with pytest.raises(tinker.PermissionDeniedError, match="not published"):
        other.create_sampling_client(model_path=path).result()
    rest.publish_checkpoint_from_tinker_path(path).result()
    assert listed(rest, training.model_id)[path].public is True
    other.create_sampling_client(model_path=path).result()
    with pytest.raises(tinker.BadRequestError, match="already public; unpublish_checkpoint_from_tinker_path"):
        rest.publish_checkpoint_from_tinker_path(path).result()
    rest.unpublish_checkpoint_from_tinker_path(path).result()
    assert listed(rest, training.model_id)[path].public is False
    with pytest.raises(tinker.PermissionDeniedError, match="not published"):
        other.create_sampling_client(model_path=path).result()
    with pytest.raises(tinker.BadRequestError, match="already private"):
        rest.unpublish_checkpoint_from_tinker_path(path).result()
    with pytest.raises(tinker.PermissionDeniedError):
        tinker.RestClient(base_url=base_url, api_key=OTHER_KEY).publish_checkpoint_from_tinker_path(path).result()


def test_a_checkpoint_named_publish_is_deleted_not_unpublished(training, rest) -> None:
    path = training.save_state("publish").result().path
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert path not in listed(rest, training.model_id)


def test_ttl_set_renewed_and_removed_shows_in_the_listing(training, rest) -> None:
    path = training.save_state("ttl").result().path
    assert listed(rest, training.model_id)[path].expires_at is None
    rest.set_checkpoint_ttl_from_tinker_path(path, 7200).result()
    first = listed(rest, training.model_id)[path].expires_at
    assert abs(first - (datetime.now(timezone.utc) + timedelta(seconds=7200))) < timedelta(seconds=30)
    rest.set_checkpoint_ttl_from_tinker_path(path, 86400).result()
    renewed = listed(rest, training.model_id)[path].expires_at
    assert renewed - first > timedelta(hours=21)
    rest.set_checkpoint_ttl_from_tinker_path(path, None).result()
    assert listed(rest, training.model_id)[path].expires_at is None
    for bad in (60, 11 * 365 * 24 * 3600):
        with pytest.raises(tinker.BadRequestError, match="ttl_seconds must be an integer between 3600"):
            rest.set_checkpoint_ttl_from_tinker_path(path, bad).result()


def test_an_expired_checkpoint_is_gone_at_once(training, rest, service_client) -> None:
    path = training.save_state("short", ttl_seconds=1).result().path
    time.sleep(1.5)
    assert path not in listed(rest, training.model_id)
    assert path not in {c.tinker_path for c in rest.list_user_checkpoints(limit=1000).result().checkpoints}
    with pytest.raises(tinker.NotFoundError, match="expired at"):
        service_client.create_training_client_from_state(path).result(timeout=60)
    with pytest.raises(tinker.NotFoundError, match="expired at"):
        rest.set_checkpoint_ttl_from_tinker_path(path, 7200).result()


def test_copy_weights_makes_an_independent_run_sharing_the_files(training, rest, service, service_client) -> None:
    source = training.save_state("to_copy").result().path
    copy = rest.copy_weights(source, "proj-archive", ttl_seconds=7200).result()
    assert copy != source and copy.endswith("/weights/to_copy")
    run = tinker.ParsedCheckpointTinkerPath.from_tinker_path(copy).training_run_id
    (entry,) = listed(rest, run).values()
    assert entry.tinker_path == copy and entry.size_bytes == listed(rest, training.model_id)[source].size_bytes
    assert entry.expires_at is not None and listed(rest, training.model_id)[source].expires_at is None
    assert run in {r.training_run_id for r in rest.list_training_runs(project_id="proj-archive").result().training_runs}
    store = service.state.store
    source_files = sorted(p for p in Path(store.get_checkpoint(source).storage_dir).rglob("*") if p.is_file())
    copy_dir = Path(store.get_checkpoint(copy).storage_dir)
    for file in source_files:  # hard links: no bytes duplicated
        assert (copy_dir / file.relative_to(store.get_checkpoint(source).storage_dir)).stat().st_ino == file.stat().st_ino
    rest.delete_checkpoint_from_tinker_path(source).result()
    resumed = service_client.create_training_client_from_state(copy).result(timeout=120)
    assert resumed.model_id != run


def test_a_retried_copy_answers_the_first_copy(training, rest, base_url: str) -> None:
    source = training.save_state("copy_once").result().path
    headers = {"X-API-Key": TEST_API_KEY, "X-Idempotency-Key": "retry-1"}
    body = {"source_path": source, "destination_project_id": "proj-a"}
    first = httpx.post(f"{base_url}/api/v1/copy_weights", headers=headers, json=body)
    again = httpx.post(f"{base_url}/api/v1/copy_weights", headers=headers, json=body)
    assert first.status_code == 200 and again.json() == first.json()
    with pytest.raises(tinker.BadRequestError, match="issues no access tokens"):
        rest.copy_weights(source, "proj-a", weights_access_token="t").result()
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds must be"):
        rest.copy_weights(source, "proj-a", ttl_seconds=5).result()


def test_another_keys_copy_needs_the_checkpoint_published(training, rest, base_url: str) -> None:
    source = training.save_state("copy_shared").result().path
    stranger = tinker.RestClient(base_url=base_url, api_key=OTHER_KEY)
    with pytest.raises(tinker.PermissionDeniedError, match="not published"):
        stranger.copy_weights(source, "theirs").result()
    rest.publish_checkpoint_from_tinker_path(source).result()
    copy = stranger.copy_weights(source, "theirs").result()
    assert copy in {c.tinker_path for c in stranger.list_user_checkpoints().result().checkpoints}


def test_list_sessions_pages_newest_first(base_url: str) -> None:
    key = "tml-pager"
    with httpx.Client(base_url=base_url, headers={"X-API-Key": key}, timeout=30) as client:
        made = [client.post("/api/v1/create_session", json={"sdk_version": "raw"}).json()["session_id"] for _ in range(5)]
    rest = tinker.RestClient(base_url=base_url, api_key=key)
    assert rest.list_sessions(limit=20).result().sessions == made[::-1]
    pages = [rest.list_sessions(limit=2, offset=offset).result().sessions for offset in (0, 2, 4, 6)]
    assert pages == [made[4:2:-1], made[2:0:-1], made[:1], []]
    for params, field in (({"limit": 0}, "limit"), ({"limit": 1001}, "limit"), ({"offset": -1}, "offset")):
        response = httpx.get(f"{base_url}/api/v1/sessions", params=params, headers={"X-API-Key": key})
        assert response.status_code == 400 and response.json()["detail"].startswith(f"{field} must be between"), response.text
    with pytest.raises(tinker.BadRequestError, match="offset must be between"):
        rest.list_user_checkpoints(offset=-1).result()
    with pytest.raises(tinker.BadRequestError, match="limit must be between 1 and 1000"):
        rest.list_training_runs(limit=5000).result()


def test_assigning_a_project_moves_the_sessions_runs(training, rest, service_client, base_url: str) -> None:
    session_id = service_client.holder.get_session_id()
    rest.assign_session_project(session_id, "proj-moved").result()
    runs = {r.training_run_id for r in rest.list_training_runs(limit=1000, project_id="proj-moved").result().training_runs}
    assert training.model_id in runs
    missing = httpx.put(f"{base_url}/api/v1/sessions/{session_id}/project", json={}, headers={"X-API-Key": TEST_API_KEY})
    assert missing.status_code == 400 and "project_id must be a non-empty string" in missing.json()["detail"]
    with pytest.raises(tinker.PermissionDeniedError):
        tinker.RestClient(base_url=base_url, api_key=OTHER_KEY).assign_session_project(session_id, "x").result()


def test_refused_routes_say_why(rest, service_client, base_url: str) -> None:
    session_id = service_client.holder.get_session_id()
    with pytest.raises(tinker.BadRequestError, match="export_session_trace is not served here"):
        rest.export_session_trace(session_id).result()
    with pytest.warns(Warning):  # search_sessions is experimental in the SDK
        future = rest.search_sessions(tinker.types.SessionSearchRequest(display_name="x"))
    with pytest.raises(tinker.BadRequestError, match="search_sessions is not served here"):
        future.result()
    headers = {"X-API-Key": TEST_API_KEY}
    unknown = httpx.get(f"{base_url}/api/v1/no_such_route", headers=headers)
    assert unknown.status_code == 404 and "this service has no route GET /api/v1/no_such_route" in unknown.json()["detail"]
    wrong_method = httpx.put(f"{base_url}/api/v1/sessions", headers=headers)
    assert wrong_method.status_code == 405 and "PUT /api/v1/sessions is not served here" in wrong_method.json()["detail"]
