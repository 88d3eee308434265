"""A two-rank worker group placed by Ray against the same group on this machine's loopback.

Both sides start ``WorkerGroup(2)`` and load the same model, then run the same
``update_actor`` steps; only the placer differs (``local``: the loopback launcher;
``ray``: a real two-node Ray cluster started here by ``ray.cluster_utils.Cluster``, one
rank on each node). Reported per side: the group's start time (placer to every rank
reporting, then ``init_model``), and the median step time over the steps after the
first. Targets: Ray's step time <= 1.1x local's (placement must not tax the steps); the
start time is reported, with no target (Ray reserves a placement group and starts an
actor per rank before the ranks themselves start).

    .venv/bin/python benchmarks/ray_placement.py [--steps 8] [--rows 16] [--model nexrl-tiny]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from nexrl_core.plugins.registry import get_placer
from nexrl_core.training.batch import Batch
from nexrl_core.types import Trajectory
from nexrl_fsdp.direct_zmq.launch import WorkerGroup

STEP_TARGET = 1.1
OPTIONS = {"loss_fn": "importance_sampling", "optimizer": {"learning_rate": 1e-4}, "micro_batch_rows": 64}


def _batch(rows: int, length: int, seed: int) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    runs = [
        Trajectory(
            tokens=torch.randint(1, 1000, (length,), generator=generator).tolist(),
            loss_mask=[0] * 4 + [1] * (length - 4),
            logprobs=[0.0] * 4 + [-2.0] * (length - 4),
            reward=0.0,
            group_id="g",
            run_id=index,
            task_id="t",
        )
        for index in range(rows)
    ]
    batch = Batch.from_trajectories(runs, pad_token_id=0)
    batch.tensors["advantages"] = batch.tensors["loss_mask"] * torch.linspace(-1, 1, rows)[:, None]
    return batch


def measure(placer: Any, model: str, steps: int, rows: int, length: int, work: Path, name: str) -> dict[str, float]:
    started = time.monotonic()
    group = WorkerGroup(2, work / f"{name}.log", placer=placer, extra_env={"OMP_NUM_THREADS": "1"}, connect_timeout_s=300)
    try:
        group.transport.init_model(model)
        start_s = time.monotonic() - started
        times = []
        for step in range(steps):
            begun = time.monotonic()
            group.transport.update_actor(_batch(rows, length, step), OPTIONS)
            times.append(time.monotonic() - begun)
    finally:
        group.stop()
    return {"start_s": start_s, "step_s": statistics.median(times[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--length", type=int, default=48)
    parser.add_argument("--model", default="nexrl-tiny")
    args = parser.parse_args()
    from ray.cluster_utils import Cluster

    from nexrl_ray.options import RayPlacerOptions

    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        local = measure(get_placer("local"), args.model, args.steps, args.rows, args.length, work, "local")
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        try:
            cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()
            placer = get_placer("ray", RayPlacerOptions(address=cluster.address))
            try:
                on_ray = measure(placer, args.model, args.steps, args.rows, args.length, work, "ray")
            finally:
                placer.close()
        finally:
            cluster.shutdown()
    ratio = on_ray["step_s"] / local["step_s"]
    print(f"model {args.model}, 2 ranks, {args.rows} rows x {args.length} tokens, median of steps 2..{args.steps}")
    print(f"{'':8}{'start (s)':>12}{'step (s)':>12}")
    for name, side in (("local", local), ("ray", on_ray)):
        print(f"{name:8}{side['start_s']:12.2f}{side['step_s']:12.3f}")
    print(f"ray/local step time {ratio:.2f}x (target <= {STEP_TARGET}x): {'PASS' if ratio <= STEP_TARGET else 'FAIL'}")
    print(f"ray/local start time {on_ray['start_s'] / local['start_s']:.2f}x (reported, no target)")


if __name__ == "__main__":
    main()
