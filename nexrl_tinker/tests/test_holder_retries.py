"""A training step whose answer the network loses is not applied twice by the Tinker holder.

The holder trains through a `DroppingProxy` in front of the local Tinker service: the
service takes each request and does the work, the proxy closes the connection instead of
passing some answers on. The tinker SDK re-sends a lost submission with its own
``seq_id`` and polls again for a lost result; the holder leaves it at that (a new call
would be a new ``seq_id``, a second step), so the model takes exactly the step a clean
run takes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import tinker

from nexrl_core.config import ModelConfig
from nexrl_core.config.adamw import AdamWSettings
from nexrl_core.training.holders import TrainStepConfig
from nexrl_core.types import RemoteDatum
from nexrl_remote_api.retries import RetriesExhausted
from nexrl_testing.dropping_proxy import DroppingProxy, Exchange
from nexrl_tinker.holder import TinkerServiceHolder
from nexrl_tinker.holder_config import TinkerHolderConfig
from nexrl_tinker.testing import TEST_API_KEY, start_service

DATUM = RemoteDatum(
    input_tokens=[19, 20, 13, 21, 22],
    target_tokens=[20, 13, 21, 22, 31],
    sampling_logprobs=[0.0] * 5,
    advantages=[0.0] * 5,
    loss_mask=[1.0] * 5,
)
STEP = TrainStepConfig(loss_fn="cross_entropy", loss_fn_config={}, optimizer=AdamWSettings(learning_rate=1e-2))


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    svc = start_service(tmp_path_factory.mktemp("retries"), api_key=TEST_API_KEY)
    try:
        yield svc
    finally:
        svc.stop()


def train_one_step(base_url: str) -> dict[str, float]:
    """One step of a new model, as a run's first step."""
    holder = TinkerServiceHolder(TinkerHolderConfig(model=ModelConfig(name="nexrl-tiny"), base_url=base_url, api_key=TEST_API_KEY))
    try:
        return holder.train([DATUM], STEP)
    finally:
        holder.close()


@pytest.fixture(scope="module")
def clean_step(service: Any) -> dict[str, float]:
    return train_one_step(service.base_url)


def optimizer_step_submission(exchange: Exchange) -> bool:
    return exchange.path == "/api/v1/optim_step"


def losing_the_first(matches: Callable[[Exchange], bool]) -> Callable[[Exchange], bool]:
    """A drop rule that loses the answer of the first exchange ``matches`` picks."""
    lost: list[Exchange] = []

    def drop(exchange: Exchange) -> bool:
        if not lost and matches(exchange):
            lost.append(exchange)
            return True
        return False

    return drop


def finished_optimizer_step() -> Callable[[Exchange], bool]:
    """Picks the poll that would tell the holder its optimizer step is done."""
    steps: set[str] = set()

    def matches(exchange: Exchange) -> bool:
        if optimizer_step_submission(exchange):
            steps.add(exchange.response_json()["request_id"])
            return False
        answer = exchange.response_json() or {}
        asked = exchange.request_json() or {}
        return exchange.path == "/api/v1/retrieve_future" and asked.get("request_id") in steps and "metrics" in answer

    return matches


@pytest.mark.parametrize(
    "drop, step_posts",
    [
        pytest.param(lambda: losing_the_first(optimizer_step_submission), 2, id="optimizer-step-submission"),
        pytest.param(lambda: losing_the_first(finished_optimizer_step()), 1, id="optimizer-step-result"),
    ],
)
def test_a_lost_answer_never_applies_a_step_twice(
    service: Any, clean_step: dict[str, float], drop: Callable[[], Callable[[Exchange], bool]], step_posts: int
) -> None:
    """``step_posts``: the optimizer step's submissions the proxy saw (the SDK's re-send
    of a lost one carries the same ``seq_id``; a lost result is polled for again)."""
    with DroppingProxy(service.base_url, drop()) as proxy:
        metrics = train_one_step(proxy.base_url)
    assert proxy.dropped, "no answer was lost"
    assert len([exchange for exchange in proxy.exchanges if optimizer_step_submission(exchange)]) == step_posts
    assert metrics["step:mean"] == 1.0, "the optimizer step was applied twice"
    for key in ("loss:sum", "grad_norm:mean"):
        assert metrics[key] == pytest.approx(clean_step[key], rel=1e-6), f"{key}: not the clean step's"


class _LostForGood:
    """A training request's future whose result the tinker SDK could not get, even after
    its own retries (what reaches the holder after five minutes without the service)."""

    def __init__(self) -> None:
        self.asked = 0

    def result(self) -> Any:
        self.asked += 1
        raise tinker.APIConnectionError(request=None)  # type: ignore[arg-type]


def test_a_training_request_the_sdk_gave_up_on_is_reported_not_sent_again() -> None:
    """Unlike sampling, a training request is never retried by the holder: the service may
    have applied it, and a new call would apply it again under a new seq_id."""
    holder = TinkerServiceHolder(TinkerHolderConfig(model=ModelConfig(name="nexrl-tiny"), base_url="http://127.0.0.1:9", max_retries=3))
    future = _LostForGood()
    with pytest.raises(RetriesExhausted, match="failed to run an optimizer step after the tinker SDK's own retries: APIConnectionError"):
        holder._result("run an optimizer step", future)
    assert future.asked == 1
