"""The Weaver service fuzzed through its own OpenAPI schema (hand-read bodies included),
and the requests that once answered 500 or were accepted wrongly refused by name.

Every route gets generated requests, valid and schema-breaking; then, as a stateful
sequence, a real session and model are created through the nex-weaver SDK, every route
is fuzzed with their ids, the session is closed, and the service still trains.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from weaver.types import Datum, ModelInput

from nexrl_core.http.serving import ServeOptions
from nexrl_service.bounds import SQL_INT_MAX
from nexrl_service.state import ServiceState
from nexrl_testing.fuzz import fuzz_app, undescribed_objects
from nexrl_weaver.server.service import WeaverService
from nexrl_weaver.testing import BASE_MODEL, sdk_client, start_service

pytestmark = pytest.mark.slow

MAX_EXAMPLES = 12
"""Generated requests per operation and mode (valid, schema-breaking)."""
HAND_READ = (
    "/api/v1/sessions",
    "/api/v1/sessions/{session_id}/models",
    "/api/v1/models/{model_id}/forward-backward-passes",
    "/api/v1/models/{model_id}/optimizer-steps",
    "/api/v1/sampling-sessions/{sampler_id}/samples",
)

NUMBERS_READ_BY_HAND = (
    "/api/v1/models/{model_id}/forward-passes",
    "/api/v1/models/{model_id}/forward-backward-passes",
    "/api/v1/models/{model_id}/optimizer-steps",
    "/api/v1/sampling-sessions/{sampler_id}/samples",
    "/api/v1/sampling-sessions/{sampler_id}/logprobs",
)
"""Routes whose bodies hold tensors or the numbers that steer sampling and training."""


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    svc = start_service(tmp_path_factory.mktemp("fuzz"))
    try:
        yield svc
    finally:
        svc.stop()


def schema_of(service: Any) -> dict[str, Any]:
    return service.create_app(service.state).openapi()


def test_the_schema_describes_the_bodies_routes_read_by_hand() -> None:
    """Down to every number of the tensor and sampling bodies, so fuzzing reaches their checks."""
    service = WeaverService(ServeOptions(port=0, data_dir=tempfile.mkdtemp()))
    schema = service.create_app(ServiceState(service.settings)).openapi()
    for path in HAND_READ:
        assert "requestBody" in schema["paths"][path]["post"], path
    for path in NUMBERS_READ_BY_HAND:
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert undescribed_objects(body) == [], path


def test_bad_bodies_are_refused_by_name(service: Any) -> None:
    with httpx.Client(base_url=f"{service.base_url}/api/v1", timeout=30) as client:
        assert client.post("/sessions", content=b"null", headers={"content-type": "application/json"}).status_code == 400
        session = client.post("/sessions", json={}).json()
        session_id = session.get("session_id") or session["id"]
        response = client.post(f"/sessions/{session_id}/models", json={"base_model": BASE_MODEL, "model_seq_id": SQL_INT_MAX + 1})
        assert response.status_code == 400 and "model_seq_id" in response.text
        response = client.post(f"/sessions/{session_id}/models", json={"base_model": BASE_MODEL, "model_seq_id": True})
        assert response.status_code == 400 and "model_seq_id" in response.text, "a boolean is not a sequence number"
        response = client.put(f"/sessions/{session_id}/models")
        assert response.status_code == 405 and "POST" in response.headers["allow"]
        response = client.get("/artifacts/x", params={"limit": "many"}, headers={"X-WEAVER-API-KEY": 7 * "x"})
        assert response.status_code < 500


def test_a_download_signature_that_is_not_ascii_is_refused(service: Any) -> None:
    response = httpx.get(f"{service.base_url}/api/v1/nexrl_downloads/x?expires=0&signature=%C3%A9", timeout=10)
    assert response.status_code == 403 and "signature" in response.text


def test_no_request_fails_the_service(service: Any) -> None:
    report = fuzz_app(schema_of(service), service.base_url, max_examples=MAX_EXAMPLES)
    print(f"Weaver service: {report.summary()}")
    assert not report.server_errors, "\n".join(report.server_errors)
    assert not report.hangs, report.hangs


def test_a_session_and_model_created_used_and_closed_under_fuzzing(service: Any) -> None:
    client = sdk_client(service.base_url)
    client.connect()
    model = client.create_model(base_model=BASE_MODEL, training_mode="lora", lora_config={"rank": 4})
    live = {"session_id": client.session_id, "model_id": model.model_id}

    def aim_at_the_live_model(case: Any) -> None:
        for name in list(case.path_parameters or {}):
            if name in live:
                case.path_parameters[name] = live[name]

    report = fuzz_app(schema_of(service), service.base_url, max_examples=MAX_EXAMPLES // 2, on_case=aim_at_the_live_model)
    print(f"Weaver service, one live session and model: {report.summary()}")
    assert not report.server_errors, "\n".join(report.server_errors)
    assert not report.hangs, report.hangs
    client.close()

    after = sdk_client(service.base_url)
    after.connect()
    trained = after.create_model(base_model=BASE_MODEL, training_mode="lora", lora_config={"rank": 4})
    datum = Datum(
        model_input=ModelInput.from_ints([19, 20, 13, 21]), loss_fn_inputs={"target_tokens": [20, 13, 21, 22], "weights": [1.0] * 4}
    )
    result = trained.forward_backward([datum], "cross_entropy")
    assert result is not None
    after.close()
