"""Training through the SDK changes the model as it should, and a re-sent submission
(the SDK re-sends a POST whose read timed out) is applied once."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import weaver
from weaver.types import AdamParams, Datum, ModelInput, SamplingParams

from nexrl_weaver.testing import sdk_client, start_service


def _datum(tokens: list[int], weights: list[float]) -> Datum:
    return Datum(model_input=ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})


@pytest.fixture
def client(base_url: str) -> Iterator[weaver.ServiceClient]:
    client = sdk_client(base_url)
    client.connect()
    yield client
    client.close()


def test_sft_halves_the_loss_and_the_sampler_reproduces_the_continuation(client: weaver.ServiceClient) -> None:
    model = client.create_model(base_model="nexrl-tiny", training_mode="full_ft")
    tokenizer = model.get_tokenizer()
    prompt = tokenizer.encode("12+7=", add_special_tokens=False)
    answer = tokenizer.encode("19", add_special_tokens=False) + [tokenizer.eos_token_id or 2]
    tokens = prompt + answer
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
    losses = []
    for _ in range(50):
        result = model.forward_backward([_datum(tokens, weights)], "cross_entropy")
        losses.append(result["metrics"]["loss:sum"])
        model.optim_step(AdamParams(learning_rate=1e-3))
        if losses[-1] < losses[0] / 4:
            break
    assert min(losses) <= losses[0] / 2, f"SFT did not halve the loss within 50 steps: {losses[0]:.3f} -> {min(losses):.3f}"
    sampler = model.save_weights_and_get_sampling_client(name="sft")
    sample = sampler.sample(
        prompt=ModelInput.from_ints(prompt), sampling_params=SamplingParams(max_tokens=len(answer), temperature=0.01, seed=0)
    )
    assert sample["sequences"][0]["tokens"] == answer


def test_a_resent_submission_is_applied_once(tmp_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A client read timeout below the time a forward-backward takes: the SDK sends the
    same POST again; the service must run it once, and the client still gets its result."""
    import httpx
    from weaver import _http

    service = start_service(tmp_path, submit_wait_s=5.0)
    try:
        client = sdk_client(service.base_url)
        client.connect()
        model = client.create_model(base_model="nexrl-tiny", training_mode="full_ft")
        tokens = [int(t) for t in range(3, 1003)]
        slow = [_datum(tokens, [1.0] * (len(tokens) - 1)) for _ in range(24)]
        monkeypatch.setattr(_http, "DEFAULT_TIMEOUT", httpx.Timeout(0.05, connect=5.0))
        impatient = sdk_client(service.base_url, session_id=client.session_id)
        impatient.connect()
        impatient._operation_seq_by_model[model.model_id] = 1  # the same model: its next seq_id
        from weaver.training_client import TrainingClient

        same_model = TrainingClient(service=impatient, model_id=model.model_id, base_model="nexrl-tiny", session_id=client.session_id)
        with caplog.at_level(logging.DEBUG, logger="weaver._http"):
            try:
                result = same_model.forward_backward(slow, "cross_entropy")
            except weaver.WeaverAPIError as exc:  # all three sends timed out: the operation still ran once
                assert exc.code == "transport_unavailable"
                result = None
        resent = [r for r in caplog.records if "forward-backward-passes" in r.getMessage() and "Connection error" in r.getMessage()]
        assert resent, "the client never timed out, so nothing was re-sent; make the operation slower"
        store = service.state.store
        rows = [row for row in store_futures(store, model.model_id) if row.kind == "ForwardBackward"]
        assert len(rows) == 1, f"a re-sent submission ran {len(rows)} times"
        if result is not None:
            assert len(result["loss_fn_outputs"]) == len(slow)
        impatient.close()  # it created no model: `client` terminates the one they share
        client.close()
    finally:
        service.stop()


def test_a_resent_finished_optimizer_step_runs_once(client: weaver.ServiceClient, base_url: str) -> None:
    """Counted by executions, not stored rows: the SDK's POST of an optimizer step that
    already finished, sent again, answers the same operation and steps nothing; the next
    step is the second."""
    import httpx

    model = client.create_model(base_model="nexrl-tiny", training_mode="full_ft")
    steps = f"{base_url}/api/v1/models/{model.model_id}/optimizer-steps"

    def step(seq_id: int) -> dict:
        body = {"payload": {"seq_id": seq_id, "adam_params": {"learning_rate": 1e-3}}}
        operation = httpx.post(steps, json=body, timeout=60).json()
        while operation["status"] == "pending":
            operation = httpx.get(f"{base_url}/api/v1/operations/{operation['id']}", timeout=60).json()
        assert operation["status"] == "done", operation
        return operation

    first = step(1)
    assert first["response"]["metrics"]["step"] == 1.0
    assert step(1)["id"] == first["id"], "a re-sent (model, seq_id) must answer the same operation"
    assert step(2)["response"]["metrics"]["step"] == 2.0, "the re-sent optimizer step ran again"


def store_futures(store, lane: str) -> list:
    from sqlalchemy import select

    from nexrl_service.store import FutureRow

    with store.tx() as session:
        return list(session.scalars(select(FutureRow).where(FutureRow.lane == lane)))
