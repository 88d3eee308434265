"""A training step whose answer the network loses is retried without being applied twice.

The holder trains through a `DroppingProxy` in front of the local Weaver service: the
service takes each request and does the work, the proxy closes the connection instead of
passing some answers on. The holder must then re-send the same request (the service
answers a ``(model, seq_id)`` it already took with the operation it started) or poll the
same operation again, never submit the step anew: the model takes exactly the step a
clean run takes, with the same gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from nexrl_core.config import ModelConfig
from nexrl_core.config.adamw import AdamWSettings
from nexrl_core.training.holders import TrainStepConfig
from nexrl_core.types import RemoteDatum
from nexrl_testing.dropping_proxy import DroppingProxy, Exchange
from nexrl_weaver.holder import WeaverServiceHolder
from nexrl_weaver.holder_config import WeaverHolderConfig
from nexrl_weaver.testing import TEST_API_KEY, start_service

DATUM = RemoteDatum(
    input_tokens=[19, 20, 13, 21, 22],
    target_tokens=[20, 13, 21, 22, 31],
    sampling_logprobs=[0.0] * 5,
    advantages=[0.0] * 5,
    loss_mask=[1.0] * 5,
)
STEP = TrainStepConfig(loss_fn="cross_entropy", loss_fn_config={}, optimizer=AdamWSettings(learning_rate=1e-2))
SDK_CONNECTION_ATTEMPTS = 3
"""The nex-weaver SDK re-sends a request whose connection broke this often before it
reports the failure to the holder; losing that many answers makes the holder's retry run."""


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Answers a submission with its operation at once (no wait for the result), so the
    holder polls for every result."""
    svc = start_service(tmp_path_factory.mktemp("retries"), api_key=TEST_API_KEY, submit_wait_s=0.0)
    try:
        yield svc
    finally:
        svc.stop()


def train_one_step(base_url: str, tensor_transport: str | None = None) -> dict[str, float]:
    """One step of a new model, as a run's first step."""
    config = WeaverHolderConfig(
        model=ModelConfig(name="nexrl-tiny"),
        base_url=base_url,
        api_key=TEST_API_KEY,
        retry_backoff_s=0.05,
        tensor_transport=tensor_transport,
    )
    holder = WeaverServiceHolder(config)
    try:
        return holder.train([DATUM], STEP)
    finally:
        holder.close()


@pytest.fixture(scope="module")
def clean_step(service: Any) -> dict[str, float]:
    return train_one_step(service.base_url)


def losing(count: int, matches: Callable[[Exchange], bool]) -> Callable[[Exchange], bool]:
    """A drop rule that loses the answers of the first ``count`` exchanges ``matches`` picks."""
    lost: list[Exchange] = []

    def drop(exchange: Exchange) -> bool:
        if len(lost) < count and matches(exchange):
            lost.append(exchange)
            return True
        return False

    return drop


def optimizer_step_submission(exchange: Exchange) -> bool:
    return exchange.method == "POST" and exchange.path.endswith("/optimizer-steps")


def forward_backward_submission(exchange: Exchange) -> bool:
    return exchange.method == "POST" and exchange.path.endswith("/forward-backward-passes")


def finished_optimizer_step() -> Callable[[Exchange], bool]:
    """Picks the poll that would tell the holder its optimizer step is done."""
    steps: set[str] = set()

    def matches(exchange: Exchange) -> bool:
        if optimizer_step_submission(exchange):
            steps.add(exchange.response_json()["id"])
            return False
        answer = exchange.response_json() or {}
        return exchange.method == "GET" and exchange.path.rsplit("/", 1)[-1] in steps and answer.get("status") == "done"

    return matches


@pytest.mark.parametrize(
    "drop, tensor_transport, step_posts",
    [
        pytest.param(
            lambda: losing(SDK_CONNECTION_ATTEMPTS, optimizer_step_submission),
            None,
            SDK_CONNECTION_ATTEMPTS + 1,
            id="optimizer-step-submission",
        ),
        pytest.param(lambda: losing(SDK_CONNECTION_ATTEMPTS, finished_optimizer_step()), None, 1, id="optimizer-step-result"),
        pytest.param(lambda: losing(1, forward_backward_submission), "http-binary", 1, id="binary-forward-backward-submission"),
    ],
)
def test_a_lost_answer_never_applies_a_step_twice(
    service: Any,
    clean_step: dict[str, float],
    drop: Callable[[], Callable[[Exchange], bool]],
    tensor_transport: str | None,
    step_posts: int,
) -> None:
    """The SDK re-sends a JSON request itself a few times, then gives up (and a binary
    one it never re-sends): what the holder does next decides whether the service runs
    the step, or its gradient, a second time. A lost result is polled for again, the
    step not sent again (``step_posts``: the optimizer step's submissions the proxy saw)."""
    with DroppingProxy(service.base_url, drop()) as proxy:
        metrics = train_one_step(proxy.base_url, tensor_transport)
    assert proxy.dropped, "no answer was lost"
    assert len([exchange for exchange in proxy.exchanges if optimizer_step_submission(exchange)]) == step_posts
    assert metrics["optim/step"] == 1.0, "the optimizer step was applied twice"
    for key in ("loss:sum", "optim/grad_norm"):
        assert metrics[key] == pytest.approx(clean_step[key], rel=1e-6), f"{key}: not the clean step's"
