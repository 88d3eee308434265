"""``nexrl train`` with its worker ranks placed by Ray, on the two one-CPU nodes of a real
Ray cluster (a rank's bundle takes a node's only CPU): the self-hosted quickstart with
``backend.options.placement: ray``, trained to the last step as on this machine's
loopback, and the quickstart's embedded Tinker service with ``backend.options.workers:
2`` and the same placement."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
NEXRL = str(Path(sys.executable).with_name("nexrl"))
SHORT = ["schedule.steps=4", "schedule.validate_every=4", "schedule.checkpoint_every=0", "task.val_size=64", "--no-progress"]


def _train(out: Path, *overrides: str, recipe: str | None = str(ROOT / "recipes" / "quickstart_fsdp.yaml")) -> list[dict[str, Any]]:
    command = [NEXRL, "train", *([recipe] if recipe else []), *SHORT, f"output.dir={out}", *overrides]
    # One thread a rank: a rank's bundle then asks for one CPU, what each node has.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=out.parent, env=env)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-5000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _run_groups(address: str, prefix: str) -> list[dict[str, Any]]:
    """The placement groups the runs made for groups named ``prefix...`` (Ray lists removed ones too, for a while)."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address)
    return [group for group in ray.util.placement_group_table().values() if group["name"].startswith(f"nexrl-{prefix}")]


def test_the_self_hosted_quickstart_on_ray_trains_like_on_this_machine(ray_cluster: Any, tmp_path: Path) -> None:
    on_ray = _train(tmp_path / "ray", "backend.options.placement=ray", f"backend.options.placement_options.address={ray_cluster.address}")
    (group,) = _run_groups(ray_cluster.address, "actor-")
    assert len(set(group["bundles_to_node_id"].values())) == 2, f"a rank on each node: {group}"
    assert group["state"] == "REMOVED", "the run removed its placement group when it ended"
    local = _train(tmp_path / "local")
    validated = {row["step"]: row["val/reward/mean"] for row in on_ray if "val/reward/mean" in row}
    assert set(validated) == {0, 4}
    assert validated[4] >= validated[0] + 0.15, f"validation reward did not rise: {validated}"
    assert validated == {row["step"]: row["val/reward/mean"] for row in local if "val/reward/mean" in row}
    steps = [row for row in on_ray if "train/loss:sum" in row]
    assert [row["step"] for row in steps] == [1, 2, 3, 4]
    for placed, here in zip(steps, (row for row in local if "train/loss:sum" in row), strict=True):
        assert placed["reward/mean"] == here["reward/mean"]
        assert placed["train/loss:sum"] == pytest.approx(here["train/loss:sum"], rel=1e-4, abs=1e-6)
        assert placed["train/actor/grad_norm"] == pytest.approx(here["train/actor/grad_norm"], rel=1e-4)


def test_the_embedded_services_worker_group_is_placed_on_ray(ray_cluster: Any, tmp_path: Path) -> None:
    placement = [
        "backend.options.workers=2",
        "backend.options.placement=ray",
        f"backend.options.placement_options.address={ray_cluster.address}",
    ]
    rows = _train(tmp_path / "embedded", *placement, "schedule.steps=2", "schedule.validate_every=0", recipe=None)
    assert [row["step"] for row in rows if "reward/mean" in row] == [1, 2]
    (group,) = _run_groups(ray_cluster.address, "model-")
    assert len(set(group["bundles_to_node_id"].values())) == 2, f"a rank on each node: {group}"
    assert group["state"] == "REMOVED", "the embedded service removed its model's placement group when the run ended"
