"""Bad requests get a 4xx with a message, and the server keeps serving."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import tinker
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from nexrl_tinker.testing import BASE_MODEL, TEST_API_KEY, start_service

HEADERS = {"X-API-Key": TEST_API_KEY}
PROTO = {"Content-Type": "application/x-protobuf"}


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, headers=HEADERS, timeout=60) as http:
        yield http


@pytest.fixture(scope="module")
def model_id(service_client) -> str:
    training = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4).result(timeout=120)
    return training.model_id


def detail(response: httpx.Response, status: int) -> str:
    """The refusal's words: ``detail``, or for a 422 ``message`` (its ``detail`` is the
    list of errors FastAPI's schema promises)."""
    assert response.status_code == status, response.text
    body = response.json()
    if status == 422:
        assert isinstance(body["detail"], list) and body["detail"]
        message = body["message"]
    else:
        message = body["detail"]
    assert isinstance(message, str) and message
    return message


def fb_request(model_id: str, seq_id: int, tokens: list[int], targets: list[int], loss_fn: str = "cross_entropy") -> bytes:
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs={"target_tokens": targets})
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn=loss_fn), model_id=model_id, seq_id=seq_id
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def test_malformed_json(client: httpx.Client) -> None:
    response = client.post("/api/v1/create_session", content=b"{not json", headers={"Content-Type": "application/json"})
    assert "malformed JSON" in detail(response, 400)
    response = client.post("/api/v1/create_model", json={"session_id": 3})
    assert "base_model" in detail(response, 422)


def test_malformed_protobuf(client: httpx.Client, model_id: str) -> None:
    response = client.post("/api/v1/forward_backward", content=b"\xff\xff\xff garbage", headers=PROTO)
    assert "protobuf" in detail(response, 400)
    response = client.post("/api/v1/forward_backward", content=b"\x28\xb5\x2f\xfd garbage", headers={**PROTO, "Content-Encoding": "zstd"})
    assert "zstd" in detail(response, 400)


@pytest.mark.parametrize("route, input_key", [("forward_backward", "forward_backward_input"), ("forward", "forward_input")])
def test_a_seq_id_past_what_sql_holds_is_refused_by_name(client: httpx.Client, model_id: str, route: str, input_key: str) -> None:
    """These bodies are read by hand, not by a pydantic model with `SeqId`: unchecked, a
    seq_id of 2**63 reaches the store's BIGINT column and answers 500 (OverflowError)."""
    datum = {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": [19, 20, 13]}]},
        "loss_fn_inputs": {"target_tokens": {"data": [20, 13, 21], "dtype": "int64"}},
    }
    body = {"model_id": model_id, "seq_id": 2**63, input_key: {"data": [datum], "loss_fn": "cross_entropy"}}
    assert "'seq_id'" in detail(client.post(f"/api/v1/{route}", json=body), 400)


def test_unknown_ids(client: httpx.Client) -> None:
    assert "unknown model" in detail(client.post("/api/v1/get_info", json={"model_id": "nope:train:0"}), 404)
    assert "unknown request 'req-nope'" in detail(
        client.post("/api/v1/retrieve_future", json={"request_id": "req-nope", "allow_metadata_only": False}), 404
    )
    assert "unknown sampling session" in detail(client.get("/api/v1/samplers/nope_0_deadbeef"), 404)
    assert "unknown model" in detail(client.get("/api/v1/training_runs/nope:train:0"), 404)
    assert "unknown session" in detail(client.post("/api/v1/session_heartbeat", json={"session_id": "nope"}), 404)
    assert "unknown checkpoint" in detail(
        client.post(
            "/api/v1/create_sampling_session",
            json={"session_id": _session(client), "sampling_session_seq_id": 0, "model_path": "tinker://x:train:0/weights/y"},
        ),
        404,
    )
    assert "tinker://" in detail(
        client.post(
            "/api/v1/create_sampling_session",
            json={"session_id": _session(client), "sampling_session_seq_id": 0, "model_path": "s3://bucket/x"},
        ),
        400,
    )


def _session(client: httpx.Client) -> str:
    return client.post("/api/v1/create_session", json={"tags": [], "sdk_version": "raw"}).json()["session_id"]


def test_another_sessions_model_is_forbidden(base_url: str, model_id: str) -> None:
    with httpx.Client(base_url=base_url, headers={"X-API-Key": "tml-someone-else"}, timeout=30) as other:
        assert "another" in detail(other.post("/api/v1/get_info", json={"model_id": model_id}), 403)
        response = other.post("/api/v1/forward_backward", content=fb_request(model_id, 1, [1, 2, 3], [2, 3, 4]), headers=PROTO)
        assert "another" in detail(response, 403)
        assert "another" in detail(other.get(f"/api/v1/training_runs/{model_id}"), 403)
        assert model_id.split(":")[0] not in other.get("/api/v1/sessions").json()["sessions"]


def test_wrong_key(base_url: str, tmp_path) -> None:
    response = httpx.post(f"{base_url}/api/v1/create_session", json={"tags": []}, headers={"X-API-Key": "not-a-tml-key"})
    assert "tml-" in detail(response, 401)
    assert "X-API-Key" in detail(httpx.post(f"{base_url}/api/v1/create_session", json={"tags": []}), 401)
    locked = start_service(tmp_path / "locked", api_key="tml-secret")
    try:
        url = locked.base_url
        wrong = httpx.post(f"{url}/api/v1/client/config", json={}, headers={"X-API-Key": "tml-wrong"})
        assert "invalid API key" in detail(wrong, 401)
        right = httpx.post(f"{url}/api/v1/client/config", json={}, headers={"X-API-Key": "tml-secret"})
        assert right.status_code == 200 and right.json()["pjwt_auth_enabled"] is False
        # Through the SDK, the same refusal surfaces as an authentication error.
        with pytest.raises(tinker.AuthenticationError):
            tinker.ServiceClient(base_url=url, api_key="tml-wrong").create_lora_training_client(base_model=BASE_MODEL, rank=4)
    finally:
        locked.stop()


def test_wrong_loss_fn_and_mismatched_lengths(service_client, client: httpx.Client) -> None:
    training = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4).result(timeout=120)
    response = client.post(
        "/api/v1/forward_backward", content=fb_request(training.model_id, 1, [1, 2, 3], [2, 3, 4], "no_such_loss"), headers=PROTO
    )
    message = detail(response, 400)
    assert "no_such_loss" in message and "cross_entropy" in message
    response = client.post("/api/v1/forward_backward", content=fb_request(training.model_id, 2, [1, 2, 3, 4, 5], [2, 3, 4]), headers=PROTO)
    assert "has shape [3] but the model input has 5 tokens" in detail(response, 400)
    # Through the SDK: a BadRequestError with the reason, and the client's later requests still run.
    bad = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3, 4]), loss_fn_inputs={"target_tokens": [1, 2]})
    with pytest.raises(tinker.BadRequestError, match="model input has 4 tokens"):
        training.forward([bad], "cross_entropy").result(timeout=60)
    good = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3, 4]})
    assert training.forward([good], "cross_entropy").result(timeout=60).metrics["loss:sum"] > 0
    with pytest.raises(tinker.BadRequestError, match="outside the vocabulary"):
        training.forward(
            [types.Datum(model_input=types.ModelInput.from_ints([1, 10**7]), loss_fn_inputs={"target_tokens": [2, 3]})],
            "cross_entropy",
        ).result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match="needs loss_fn_inputs"):
        training.forward_backward([good], "importance_sampling").result(timeout=60)


def test_bad_sampling_and_checkpoint_requests(service_client, client: httpx.Client) -> None:
    training = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4).result(timeout=120)
    with pytest.raises(tinker.BadRequestError, match="invalid checkpoint name"):
        training.save_state("a/b").result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match="unknown base model"):
        service_client.create_sampling_client(base_model="Qwen/Qwen3-8B").result(timeout=60)
    sampler = service_client.create_sampling_client(base_model=BASE_MODEL).result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match="temperature"):
        sampler.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2, temperature=-1.0)).result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match="empty"):
        sampler.sample(types.ModelInput.from_ints([]), 1, types.SamplingParams(max_tokens=2)).result(timeout=60)
    response = client.post(
        "/api/v1/load_weights",
        json={"model_id": training.model_id, "seq_id": 9, "path": "tinker://x/sampler_weights/y", "optimizer": False},
    )
    assert "training-state path" in detail(response, 400)


def test_still_healthy(client: httpx.Client) -> None:
    response = client.get("/api/v1/healthz")
    assert response.status_code == 200 and response.json()["status"] == "ok"
