"""Per-model ordering and deduplication, driven with raw httpx and the SDK's own protobuf."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from nexrl_tinker.testing import BASE_MODEL, TEST_API_KEY, start_service

HEADERS = {"X-API-Key": TEST_API_KEY}
TOKENS = [19, 20, 13, 21, 22, 31, 22, 24, 5, 7, 9]


@pytest.fixture(scope="module")
def fast_poll_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A server whose long-poll gives up after 1 s, so "not done yet" is quick to see."""
    service = start_service(tmp_path_factory.mktemp("ordering"), long_poll_s=1.0)
    try:
        yield service.base_url
    finally:
        service.stop()


def retrieve(client: httpx.Client, request_id: str, deadline_s: float = 120.0) -> httpx.Response:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        response = client.post("/api/v1/retrieve_future", json={"request_id": request_id, "allow_metadata_only": False})
        assert response.status_code == 200, response.text
        if "json" in response.headers["content-type"] and response.json().get("type") == "try_again":
            continue
        return response
    raise AssertionError(f"{request_id} never finished")


def new_model(client: httpx.Client) -> str:
    session = client.post("/api/v1/create_session", json={"tags": [], "user_metadata": None, "sdk_version": "raw"})
    session_id = session.json()["session_id"]
    created = client.post(
        "/api/v1/create_model",
        json={"session_id": session_id, "model_seq_id": 0, "base_model": BASE_MODEL, "lora_config": {"rank": 4}},
    ).json()
    assert retrieve(client, created["request_id"]).json()["model_id"] == created["model_id"]
    return created["model_id"]


def fb_body(model_id: str, seq_id: int, forward_only: bool, loss_fn: str = "cross_entropy") -> bytes:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)},
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn=loss_fn),
        model_id=model_id,
        seq_id=seq_id,
    )
    message = forward_backward_request_to_proto(request)
    message.forward_only = forward_only
    return message.SerializeToString()


def post_fb(client: httpx.Client, model_id: str, seq_id: int, forward_only: bool) -> str:
    response = client.post(
        "/api/v1/forward_backward",
        content=fb_body(model_id, seq_id, forward_only),
        headers={"Content-Type": "application/x-protobuf"},
    )
    assert response.status_code == 200, response.text
    return response.json()["request_id"]


def post_optim(client: httpx.Client, model_id: str, seq_id: int, lr: float = 0.02) -> str:
    response = client.post(
        "/api/v1/optim_step",
        json={"model_id": model_id, "seq_id": seq_id, "adam_params": {"learning_rate": lr}, "type": "optim_step"},
    )
    assert response.status_code == 200, response.text
    return response.json()["request_id"]


def loss_of(client: httpx.Client, request_id: str) -> float:
    response = retrieve(client, request_id)
    assert response.headers["content-type"].startswith("application/x-protobuf")
    return deserialize_forward_backward_output(response.content).metrics["loss:sum"]


def test_out_of_order_submissions_run_in_seq_order_and_once(fast_poll_url: str) -> None:
    with httpx.Client(base_url=fast_poll_url, headers=HEADERS, timeout=60) as client:
        model_id = new_model(client)
        # Submitted backwards: 4 (forward), 3 (optim), 2 (forward_backward), a duplicate of 3, then 1.
        r4 = post_fb(client, model_id, 4, forward_only=True)
        r3 = post_optim(client, model_id, 3)
        r2 = post_fb(client, model_id, 2, forward_only=False)
        duplicate = post_optim(client, model_id, 3)
        assert duplicate == r3, "a resubmitted (model_id, seq_id) must get the same future"

        # Nothing can run while seq 1 is missing: the long-poll times out with try_again.
        pending = client.post("/api/v1/retrieve_future", json={"request_id": r4, "allow_metadata_only": True})
        assert pending.json() == {"type": "try_again", "request_id": r4, "queue_state": "active"}
        assert client.get("/api/v1/healthz").json()["requests_in_flight"] == 3

        r1 = post_fb(client, model_id, 1, forward_only=True)
        loss1, loss2, loss4 = loss_of(client, r1), loss_of(client, r2), loss_of(client, r4)
        step = retrieve(client, r3).json()["metrics"]
        # 1 and 2 saw the initial weights, 4 ran after the optimizer step of 3.
        assert loss1 == pytest.approx(loss2, rel=1e-6)
        assert loss4 < loss1 - 1e-3
        assert step["step:mean"] == 1.0
        # Seq 5, a second optimizer step, is the second one: seq 3 was applied once.
        assert retrieve(client, post_optim(client, model_id, 5)).json()["metrics"]["step:mean"] == 2.0
        # A duplicate after completion still answers the same finished future, and runs
        # nothing: the next optimizer step is the third, not the fourth.
        assert post_optim(client, model_id, 3) == r3
        assert retrieve(client, post_optim(client, model_id, 6)).json()["metrics"]["step:mean"] == 3.0


def test_refused_submission_does_not_block_later_ones(fast_poll_url: str) -> None:
    with httpx.Client(base_url=fast_poll_url, headers=HEADERS, timeout=60) as client:
        model_id = new_model(client)
        bad = client.post(
            "/api/v1/forward_backward",
            content=fb_body(model_id, 1, False, loss_fn="no_such_loss"),
            headers={"Content-Type": "application/x-protobuf"},
        )
        assert bad.status_code == 400 and "no_such_loss" in bad.json()["detail"]
        good = post_fb(client, model_id, 2, forward_only=True)
        assert loss_of(client, good) > 0


def test_a_request_resent_after_a_restart_runs_nothing_on_a_worker_group(tmp_path: Path) -> None:
    """A client that lost the answer to an optimizer step sends it again, and meanwhile
    the service restarted (``--workers 1``): the restarted process has never seen the
    request, rebuilds the model's group from its journal (which applied the step once
    already) and must answer the stored future, not run the step a second time."""
    service = start_service(tmp_path, api_key=TEST_API_KEY, workers=1)
    try:
        with httpx.Client(base_url=service.base_url, headers=HEADERS, timeout=120) as client:
            model_id = new_model(client)
            loss_of(client, post_fb(client, model_id, 1, forward_only=False))
            stepped = post_optim(client, model_id, 2)
            assert retrieve(client, stepped).json()["metrics"]["step:mean"] == 1.0
    finally:
        service.stop()
    service = start_service(tmp_path, api_key=TEST_API_KEY, workers=1)
    try:
        with httpx.Client(base_url=service.base_url, headers=HEADERS, timeout=120) as client:
            assert post_optim(client, model_id, 2) == stepped, "a re-sent (model, seq_id) must get the same future"
            following = retrieve(client, post_optim(client, model_id, 3), deadline_s=60)
            assert following.json()["metrics"]["step:mean"] == 2.0, "the re-sent step ran again"
            assert retrieve(client, stepped, deadline_s=10).json()["metrics"]["step:mean"] == 1.0
    finally:
        service.stop()
