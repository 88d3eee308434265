"""Bad requests get a 4xx with Weaver's JSON error body naming what was wrong; another
tenant's resources are a 403; the key is checked when the server has one."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import weaver

from nexrl_weaver.testing import TEST_API_KEY, sdk_client


@pytest.fixture(scope="module")
def model_id(keyed_base_url: str) -> Iterator[str]:
    client = sdk_client(keyed_base_url, api_key=TEST_API_KEY)
    client.connect()
    yield client.create_model(base_model="nexrl-tiny", training_mode="full_ft").model_id
    client.close()


def _post(base_url: str, path: str, key: str | None = TEST_API_KEY, headers: dict[str, str] | None = None, **kwargs) -> httpx.Response:
    sent = {"X-WEAVER-API-KEY": key} if key else {}
    return httpx.post(f"{base_url}/api/v1{path}", headers={**sent, **(headers or {})}, timeout=30, **kwargs)


def _error(response: httpx.Response, status: int, fragment: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["retryable"] is False and body["error"] and fragment in body["message"], body


def test_missing_and_wrong_keys_are_401(keyed_base_url: str) -> None:
    _error(_post(keyed_base_url, "/sessions", key=None, json={}), 401, "X-WEAVER-API-KEY")
    _error(_post(keyed_base_url, "/sessions", key="sk-other", json={}), 401, "invalid API key")
    with pytest.raises(weaver.WeaverAPIError, match="401"):
        sdk_client(keyed_base_url).connect()


def test_malformed_bodies_are_400(keyed_base_url: str, model_id: str) -> None:
    path = f"/models/{model_id}/forward-backward-passes"
    _error(_post(keyed_base_url, path, content=b"{not json", headers={"content-type": "application/json"}), 400, "malformed JSON")
    _error(_post(keyed_base_url, path, json=[1, 2]), 400, "JSON object")
    _error(_post(keyed_base_url, path, json={"payload": {"seq_id": 50}}), 400, "forward_backward_input is required")
    bad_datum = {
        "payload": {
            "seq_id": 51,
            "forward_backward_input": {
                "loss_fn": "cross_entropy",
                "data": [
                    {"model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}, "loss_fn_inputs": {"target_tokens": [1]}}
                ],
            },
        }
    }
    _error(_post(keyed_base_url, path, json=bad_datum), 400, "each position needs one value")
    _error(
        _post(keyed_base_url, f"/models/{model_id}/optimizer-steps", json={"payload": {"seq_id": 52, "adam_params": {"beta9": 1}}}),
        400,
        "unknown fields ['beta9']",
    )
    _error(_post(keyed_base_url, f"/models/{model_id}/load", json={"path": "s3://x"}), 400, "weaver://")
    multipart = b'--b\r\nContent-Disposition: form-data; name="manifest"\r\n\r\n{}\r\n--b--\r\n'
    _error(_post(keyed_base_url, path, content=multipart, headers={"content-type": "multipart/form-data; boundary=b"}), 400, "tensor_pack")
    _error(_post(keyed_base_url, "/sessions/nope/models", json={"base_model": "nexrl-tiny"}), 404, "unknown session")


def test_another_tenants_model_is_403(base_url: str) -> None:
    owner = sdk_client(base_url, api_key="sk-owner")
    owner.connect()
    try:
        model = owner.create_model(base_model="nexrl-tiny", training_mode="full_ft")
        _error(
            _post(
                base_url, f"/models/{model.model_id}/optimizer-steps", key="sk-intruder", json={"payload": {"seq_id": 1, "adam_params": {}}}
            ),
            403,
            "another",
        )
        anonymous = httpx.get(f"{base_url}/api/v1/models/{model.model_id}", timeout=30)
        _error(anonymous, 403, "another")
    finally:
        owner.close()


def test_log_metrics_is_refused_not_dropped(keyed_base_url: str) -> None:
    client = sdk_client(keyed_base_url, api_key=TEST_API_KEY)
    client.connect()
    try:
        model = client.create_model(base_model="nexrl-tiny", training_mode="full_ft")
        with pytest.raises(weaver.WeaverAPIError, match="501.*log_metrics is not supported"):
            model.log_metrics({"reward": 1.0}, step=1)
    finally:
        client.close()
