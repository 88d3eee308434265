"""Contract every transport must meet, against real workers.

Subclass `TransportContract` and override the ``transport`` fixture to return an
initialised transport whose workers have loaded ``init_model(model_name)`` (share one
worker group per module: it is expensive). The checks: logprobs come back in the
batch's layout, a malformed batch is refused with a message naming the tensor and the
workers stay usable, training returns float metrics and changes the logprobs.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from nexrl_core.training.batch import Batch
from nexrl_core.types import Trajectory


def make_batch(rows: int = 3, seed: int = 0, vocab: int = 100) -> Batch:
    """A small batch of rows of different lengths with advantages (odd row counts test padding)."""
    generator = torch.Generator().manual_seed(seed)
    runs = []
    for index in range(rows):
        prompt = torch.randint(1, vocab, (2 + index % 2,), generator=generator).tolist()
        response = torch.randint(1, vocab, (2 + index,), generator=generator).tolist()
        runs.append(
            Trajectory(
                tokens=prompt + response,
                loss_mask=[0] * len(prompt) + [1] * len(response),
                logprobs=[0.0] * len(prompt) + [-1.0] * len(response),
                reward=float(index % 2),
                group_id="g",
                run_id=index,
                task_id="t",
            )
        )
    batch = Batch.from_trajectories(runs, pad_token_id=0)
    batch.tensors["advantages"] = batch.tensors["loss_mask"] * torch.linspace(-1, 1, rows)[:, None]
    return batch


class TransportContract:
    """Subclass me and provide ``transport`` (and, if needed, ``update_options``)."""

    @pytest.fixture
    def transport(self) -> Any:
        raise NotImplementedError("override the 'transport' fixture to return an initialised transport with a model loaded")

    @pytest.fixture
    def update_options(self) -> dict[str, Any]:
        return {"loss_fn": "importance_sampling", "optimizer": {"learning_rate": 1e-3}}

    def test_log_probs_come_back_in_the_batch_layout(self, transport: Any) -> None:
        batch = make_batch()
        logprobs = transport.compute_log_prob(batch)
        assert tuple(logprobs.shape) == tuple(batch.tensors["input_ids"].shape)
        assert torch.isfinite(logprobs).all()
        assert (logprobs[batch.tensors["attention_mask"] == 0] == 0).all()
        assert (logprobs[batch.tensors["attention_mask"] == 1] <= 0).all()

    def test_a_malformed_batch_is_refused_by_name_and_the_workers_stay_usable(self, transport: Any, update_options: dict[str, Any]) -> None:
        batch = make_batch()
        batch.tensors["loss_mask"] = batch.tensors["loss_mask"][:, :-1].contiguous()
        with pytest.raises(Exception, match="loss_mask"):
            transport.update_actor(batch, update_options)
        assert transport.compute_log_prob(make_batch()).shape[0] == 3

    def test_update_returns_float_metrics_and_moves_the_policy(self, transport: Any, update_options: dict[str, Any]) -> None:
        batch = make_batch(seed=1)
        before = transport.compute_log_prob(batch)
        metrics = transport.update_actor(batch, update_options)
        assert metrics and all(isinstance(v, float) and not math.isnan(v) for v in metrics.values())
        after = transport.compute_log_prob(batch)
        assert not torch.equal(before, after)

    def test_reference_log_probs_do_not_move_with_training(self, transport: Any, update_options: dict[str, Any]) -> None:
        batch = make_batch(seed=2)
        before = transport.compute_ref_log_prob(batch)
        transport.update_actor(batch, update_options)
        torch.testing.assert_close(transport.compute_ref_log_prob(batch), before)
