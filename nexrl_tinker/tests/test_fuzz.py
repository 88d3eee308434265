"""The Tinker service fuzzed through its own OpenAPI schema, and the requests that once
answered 500 refused by name.

Every route gets generated requests, valid and schema-breaking, with the test's API key;
then, as a stateful sequence, a real session and model are created, every route is fuzzed
with their ids in its path and body, the session is ended, and the service still trains.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import tinker

from nexrl_service.bounds import SQL_INT_MAX
from nexrl_testing.fuzz import fuzz_app, undescribed_objects
from nexrl_tinker.testing import BASE_MODEL, TEST_API_KEY, start_service

pytestmark = pytest.mark.slow

MAX_EXAMPLES = 12
"""Generated requests per operation and mode (valid, schema-breaking)."""
HEADERS = {"X-API-Key": TEST_API_KEY}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    svc = start_service(tmp_path_factory.mktemp("fuzz"), api_key=TEST_API_KEY)
    try:
        yield svc
    finally:
        svc.stop()


def http(service: Any) -> httpx.Client:
    return httpx.Client(base_url=f"{service.base_url}/api/v1", headers=HEADERS, timeout=30)


def new_session(client: httpx.Client) -> str:
    return client.post("/create_session", json={"tags": [], "sdk_version": "fuzz"}).json()["session_id"]


def test_the_schema_describes_every_body() -> None:
    """Down to the numbers of the bodies read by hand, so fuzzing reaches their checks."""
    import tempfile

    from nexrl_core.http.serving import ServeOptions
    from nexrl_service.state import ServiceState
    from nexrl_tinker.server.service import TinkerService

    service = TinkerService(ServeOptions(port=0, data_dir=tempfile.mkdtemp()))
    schema = service.create_app(ServiceState(service.settings)).openapi()
    for path in ("/api/v1/forward_backward", "/api/v1/forward", "/api/v1/create_model", "/api/v1/optim_step"):
        assert "requestBody" in schema["paths"][path]["post"], path
    for path in ("/api/v1/forward_backward", "/api/v1/forward"):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert undescribed_objects(body) == [], path
        assert body["properties"]["seq_id"]["maximum"] == SQL_INT_MAX


def test_sequence_numbers_past_what_sql_holds_are_refused_by_name(service: Any) -> None:
    with http(service) as client:
        session = new_session(client)
        body = {"session_id": session, "model_seq_id": SQL_INT_MAX + 1, "base_model": BASE_MODEL, "lora_config": {"rank": 0}}
        response = client.post("/create_model", json=body)
        assert response.status_code == 422 and "model_seq_id" in response.text
        response = client.post(
            "/create_sampling_session", json={"session_id": session, "sampling_session_seq_id": 2**64, "base_model": BASE_MODEL}
        )
        assert response.status_code == 422 and "sampling_session_seq_id" in response.text
        response = client.post("/optim_step", json={"model_id": "x", "seq_id": False})
        assert response.status_code == 422 and "seq_id" in response.text, "a boolean is not a sequence number"
        assert isinstance(response.json()["detail"], list), "a 422's detail is the list FastAPI's schema promises"


def test_a_download_signature_that_is_not_ascii_is_refused(service: Any) -> None:
    response = httpx.get(f"{service.base_url}/api/v1/nexrl_downloads/x?expires=0&signature=%C3%A9", timeout=10)
    assert response.status_code == 403 and "signature" in response.text


def test_no_request_fails_the_service(service: Any) -> None:
    report = fuzz_app(service.create_app(service.state).openapi(), service.base_url, headers=HEADERS, max_examples=MAX_EXAMPLES)
    print(f"Tinker service: {report.summary()}")
    assert not report.server_errors, "\n".join(report.server_errors)
    assert not report.hangs, report.hangs


def test_a_session_and_model_created_used_and_ended_under_fuzzing(service: Any) -> None:
    client = tinker.ServiceClient(base_url=service.base_url, api_key=TEST_API_KEY)
    training = client.create_lora_training_client(base_model=BASE_MODEL, rank=4).result(timeout=300)
    session = client.holder.get_session_id()
    live = {"session_id": session, "model_id": training.model_id}

    def aim_at_the_live_model(case: Any) -> None:
        for name in list(case.path_parameters or {}):
            if name in live:
                case.path_parameters[name] = live[name]
        if isinstance(case.body, dict):
            case.body.update({key: value for key, value in live.items() if key in case.body})

    report = fuzz_app(
        service.create_app(service.state).openapi(),
        service.base_url,
        headers=HEADERS,
        max_examples=MAX_EXAMPLES // 2,
        on_case=aim_at_the_live_model,
    )
    print(f"Tinker service, one live session and model: {report.summary()}")
    assert not report.server_errors, "\n".join(report.server_errors)
    assert not report.hangs, report.hangs
    client.close("success").result(timeout=60)

    after = tinker.ServiceClient(base_url=service.base_url, api_key=TEST_API_KEY)
    trained = after.create_lora_training_client(base_model=BASE_MODEL, rank=4).result(timeout=300)
    datum = tinker.types.Datum(
        model_input=tinker.types.ModelInput.from_ints([19, 20, 13, 21]),
        loss_fn_inputs={"target_tokens": [20, 13, 21, 22], "weights": [1.0] * 4},
    )
    assert trained.forward_backward([datum], "cross_entropy").result(timeout=120).metrics["loss:sum"] > 0
    after.close("success").result(timeout=60)
