"""Every op gives every rank the same collectives, whatever rows each rank holds.

FSDP all-gathers the weights inside each forward, so every rank must run as many
forwards as the others. The rows of a step are not alike: one rank's rows may share a
prompt (prefix sharing then runs the model twice, prefix and suffixes), another's may
not (one plain pass), and a rank may hold only padding rows, or, for the engine ops,
no datum at all. Here rows 0-2 share a prompt and rows 3-5 do not, so on 2 ranks rank
0 shares and rank 1 does not, and on 4 ranks only rank 0 could share and rank 3 holds
padding. Each op must finish (a mismatch hangs until the op deadline) and equal one
process's plain pass on the same weights. Passes packed by a token budget differ too:
16 tokens hold one real row (13-15 tokens) but both padding rows of 1 token, so on 4
ranks ranks 0-2 run two passes where rank 3 needs one.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from nexrl_core.config.adamw import AdamWSettings
from nexrl_core.training.batch import Batch
from nexrl_core.types import Trajectory
from nexrl_engine import Datum, Engine
from nexrl_engine.loss_fns import build_loss_fn, check_datums
from nexrl_engine.shared_prefix import plan_prefix_sharing
from nexrl_fsdp.direct_zmq.datums import datum_tensors
from nexrl_fsdp.direct_zmq.launch import WorkerGroup

pytestmark = pytest.mark.slow

ADVANTAGES = [0.7, -1.2, 0.4, 1.5, -0.3, 0.9]
FROZEN = AdamWSettings(learning_rate=0.0, weight_decay=0.0, grad_clip_norm=0.0)
"""A step that measures the gradient and moves nothing, so the group stays at its seed weights."""
PASS_LIMITS = {"rows": {"micro_batch_rows": 8}, "tokens": {"micro_batch_rows": 8, "max_tokens_per_microbatch": 16}}
"""Passes of up to 8 rows, or of up to 16 padded tokens (one real row, or both padding rows)."""


def _runs() -> list[Trajectory]:
    """Rows 0-2 answer one 12-token prompt, rows 3-5 each have a prompt of their own."""
    generator = torch.Generator().manual_seed(1)
    shared = torch.randint(1, 1000, (12,), generator=generator).tolist()
    runs = []
    for index, advantage in enumerate(ADVANTAGES):
        prompt = shared if index < 3 else torch.randint(1, 1000, (12,), generator=generator).tolist()
        response = torch.randint(1, 1000, (2 + index % 3,), generator=generator).tolist()
        logprobs = [0.0] * len(prompt) + (-torch.rand(len(response), generator=generator) * 3).tolist()
        runs.append(
            Trajectory(
                tokens=prompt + response,
                loss_mask=[0] * len(prompt) + [1] * len(response),
                logprobs=logprobs,
                reward=advantage,
                group_id="g",
                run_id=index,
                task_id="t",
            )
        )
    return runs


def _batch() -> Batch:
    batch = Batch.from_trajectories(_runs(), pad_token_id=0)
    batch.tensors["advantages"] = batch.tensors["loss_mask"] * torch.tensor(ADVANTAGES)[:, None]
    return batch


def _datums(runs: list[Trajectory]) -> list[Datum]:
    return [
        Datum(
            input_tokens=run.tokens[:-1],
            loss_fn_inputs={
                "target_tokens": run.tokens[1:],
                "logprobs": run.logprobs[1:],
                "advantages": [advantage * m for m in run.loss_mask[1:]],
                "mask": [float(m) for m in run.loss_mask[1:]],
            },
        )
        for run, advantage in zip(runs, ADVANTAGES)
    ]


def test_the_rows_are_what_the_module_says() -> None:
    """Rows 0-2 are worth sharing and rows 3-5 are not, or the tests below check nothing."""
    tokens = [run.tokens[:-1] for run in _runs()]
    assert plan_prefix_sharing(tokens[:3]) is not None
    assert plan_prefix_sharing(tokens[:2]) is not None
    assert plan_prefix_sharing(tokens[3:]) is None and plan_prefix_sharing(tokens[2:4]) is None


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(model="nexrl-tiny", seed=0, share_prefixes=False)


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda ranks: f"{ranks}-ranks")
def group(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerGroup]:
    workers = WorkerGroup(
        request.param,
        tmp_path_factory.mktemp("uneven") / "workers.log",
        heartbeat_s=0.5,
        dead_after_s=10,
        op_timeout_s=60,
        extra_env={"NEXRL_WORKER_COLLECTIVE_TIMEOUT_S": "30"},
    )
    try:
        workers.transport.init_model("nexrl-tiny", dtype="float32", seed=0)
        yield workers
    finally:
        workers.stop()


def _expected_log_probs(engine: Engine, batch: Batch) -> torch.Tensor:
    out = torch.zeros_like(batch.tensors["loss_mask"])
    for row, values in enumerate(engine.compute_logprobs([run.tokens for run in _runs()])):
        columns = torch.nonzero(batch.tensors["attention_mask"][row]).flatten()
        out[row, columns[1:]] = torch.tensor(values[1:], dtype=torch.float32)
    return out


@pytest.mark.parametrize("limits", PASS_LIMITS.values(), ids=PASS_LIMITS)
def test_log_prob_passes_meet_on_every_rank(group: WorkerGroup, engine: Engine, limits: dict[str, int]) -> None:
    batch = _batch()
    expected = _expected_log_probs(engine, batch)
    for op in (group.transport.compute_log_prob, group.transport.compute_ref_log_prob):
        torch.testing.assert_close(op(batch, **limits), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("limits", PASS_LIMITS.values(), ids=PASS_LIMITS)
def test_update_actor_meets_on_every_rank(group: WorkerGroup, engine: Engine, limits: dict[str, int]) -> None:
    reference = engine.forward_backward(_datums(_runs()), "importance_sampling", {"agg_mode": "token-mean"})
    norm = engine.optim_step(FROZEN).grad_norm
    metrics = group.transport.update_actor(
        _batch(),
        {"loss_fn": "importance_sampling", "loss_fn_config": {"agg_mode": "token-mean"}, "optimizer": FROZEN.to_json(), **limits},
    )
    assert metrics["actor/grad_norm"] == pytest.approx(norm, rel=1e-4)
    assert metrics["loss:mean"] == pytest.approx(reference.metrics["loss:mean"], rel=1e-4)
    rows_per_rank = -(-len(ADVANTAGES) // group.nproc)
    expected_passes = 1 if "max_tokens_per_microbatch" not in limits else rows_per_rank  # 16 tokens: one real row a pass
    assert metrics["actor/passes"] == expected_passes


@pytest.mark.parametrize("count", [6, 2], ids=["every-rank-some", "some-ranks-none"])
def test_engine_ops_meet_on_every_rank(group: WorkerGroup, engine: Engine, count: int) -> None:
    """``forward`` with backward and ``optim_step``: with 2 datums on 4 ranks two ranks hold none."""
    datums = _datums(_runs())[:count]
    reference = engine.forward_backward(datums, "ppo")
    norm = engine.optim_step(FROZEN).grad_norm
    checked = check_datums(datums, build_loss_fn("ppo"), engine.vocab_size)
    reply = group.transport.forward(datum_tensors(checked), {"loss_fn": "ppo", "backward": True})
    step = group.transport.optim_step(FROZEN.to_json())
    assert reply.header["metrics"]["loss:sum"] == pytest.approx(reference.metrics["loss:sum"], rel=1e-4)
    assert step["grad_norm"] == pytest.approx(norm, rel=1e-4)
