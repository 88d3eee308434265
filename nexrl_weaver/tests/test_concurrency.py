"""Sixteen SDK clients at once on one Weaver service, on SQLite and on PostgreSQL: every
operation is answered exactly once, nothing is lost or applied twice."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import weaver
from nexrl_weaver.testing import start_service
from weaver.types import AdamParams, Datum, ModelInput, SamplingParams

CLIENTS = 16
STEPS = 3


@pytest.fixture
def base_url(tmp_path: Path, sql_url: str) -> Iterator[str]:
    service = start_service(tmp_path / "data", db=sql_url)
    try:
        yield service.base_url
    finally:
        service.stop()


def one_client(base_url: str, index: int) -> tuple[list[float], list[int], str]:
    """Trains its own model STEPS times and samples once; returns the optimizer step
    counter after each step, the sample's tokens, and its model id."""
    tokens = [(index * 7 + j) % 50 + 3 for j in range(12)]
    datum = Datum(model_input=ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 11})
    client = weaver.ServiceClient(base_url=base_url)
    client.connect()
    try:
        model = client.create_model(base_model="nexrl-tiny", training_mode="full_ft")
        counters = []
        for _ in range(STEPS):
            model.forward_backward([datum], "cross_entropy")
            counters.append(model.optim_step(AdamParams(learning_rate=1e-3))["metrics"]["step"])
        sampler = model.save_weights_and_get_sampling_client(name=f"c{index}")
        sample = sampler.sample(prompt=ModelInput.from_ints(tokens[:4]), sampling_params=SamplingParams(max_tokens=3, seed=index))
        return counters, list(sample["sequences"][0]["tokens"]), model.model_id
    finally:
        client.close()


@pytest.mark.slow
def test_sixteen_clients_at_once(base_url: str) -> None:
    with ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(lambda index: one_client(base_url, index), range(CLIENTS)))
    for counters, sample, _ in results:
        assert counters == [float(step) for step in range(1, STEPS + 1)], "an optimizer step was lost or applied twice"
        assert 0 < len(sample) <= 3
    assert len({model_id for _, _, model_id in results}) == CLIENTS
