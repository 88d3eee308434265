"""``tensor_transport`` of the Weaver holder, on a real holder against the real local
service: ``http-binary`` makes the service answer a step's output tensors as a binary
tensor pack (``default``, as JSON), and the step's numbers do not depend on which."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select

from nexrl_core.config import ModelConfig
from nexrl_core.testing.loss_option_contract import FROZEN, probe_datums
from nexrl_core.training.holders import TrainStepConfig
from nexrl_service.futures import JSON_CONTENT_TYPE
from nexrl_service.store import FutureRow
from nexrl_weaver.holder import WeaverServiceHolder
from nexrl_weaver.holder_config import WeaverHolderConfig
from nexrl_weaver.server.operations import PACKED_CONTENT_TYPE


def step_answers(service: Any, transport: str) -> tuple[dict[str, float], list[str | None]]:
    """One frozen step of a new holder; its metrics, and the content type the service
    stored for each of its model's forward-backward answers."""
    holder = WeaverServiceHolder(
        WeaverHolderConfig(model=ModelConfig(name="nexrl-tiny"), base_url=service.base_url, tensor_transport=transport)
    )
    try:
        metrics = holder.train(probe_datums(holder), TrainStepConfig(loss_fn="ppo", optimizer=FROZEN))
        model_id = holder._training_client().model_id
    finally:
        holder.close()
    with service.state.store.tx() as session:
        rows = session.scalars(select(FutureRow).where(FutureRow.lane == model_id, FutureRow.kind == "ForwardBackward"))
        return metrics, [row.content_type for row in rows]


def test_http_binary_answers_with_a_tensor_pack_and_the_same_step(service: Any) -> None:
    binary, binary_types = step_answers(service, "http-binary")
    json_, json_types = step_answers(service, "default")
    assert binary_types == [PACKED_CONTENT_TYPE], "tensor_transport=http-binary did not reach the service"
    assert json_types == [JSON_CONTENT_TYPE]
    assert binary.keys() == json_.keys()
    for key, value in json_.items():
        assert binary[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
