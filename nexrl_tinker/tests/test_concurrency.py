"""Sixteen SDK clients at once on one service, on SQLite and on PostgreSQL: every
operation is answered exactly once, nothing is lost or applied twice."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import tinker
from nexrl_tinker.testing import BASE_MODEL, start_service
from tinker import types

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
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    with tinker.ServiceClient(base_url=base_url) as client:
        training = client.create_lora_training_client(base_model=BASE_MODEL, rank=2, seed=index).result(timeout=300)
        counters = []
        for _ in range(STEPS):
            training.forward_backward([datum], "cross_entropy").result(timeout=300)
            metrics = training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=300).metrics
            counters.append(metrics["step:mean"])
        sample = training.save_weights_and_get_sampling_client().result(timeout=300).sample(
            types.ModelInput.from_ints(tokens[:4]), num_samples=1, sampling_params=types.SamplingParams(max_tokens=3, seed=index)
        ).result(timeout=300)
        return counters, list(sample.sequences[0].tokens), training.model_id


@pytest.mark.slow
def test_sixteen_clients_at_once(base_url: str) -> None:
    with ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(lambda index: one_client(base_url, index), range(CLIENTS)))
    for counters, sample, _ in results:
        assert counters == [float(step) for step in range(1, STEPS + 1)], "an optimizer step was lost or applied twice"
        assert 0 < len(sample) <= 3
    assert len({model_id for _, _, model_id in results}) == CLIENTS
