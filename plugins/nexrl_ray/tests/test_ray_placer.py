"""The ray placer on a real two-node Ray cluster: where ranks land, their rendezvous, and
that what it creates is gone when a group ends or cannot be placed."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from nexrl_core.plugins.registry import get_placer
from nexrl_core.training.placement import PlacementRequest, PlacementUnavailable
from nexrl_ray.options import RayPlacerOptions

RENDEZVOUS = """
import json, os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "NEXRL_WORKER_IP", "GROUP_SECRET")
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as out:
    json.dump({"sum": total.item(), "pid": os.getpid(), **{key: os.environ.get(key) for key in keys}}, out)
dist.destroy_process_group()
time.sleep(float(sys.argv[2]))
"""


def _placer(cluster: Any, **options: Any) -> Any:
    return get_placer("ray", RayPlacerOptions(address=cluster.address, **options))


def _request(tmp_path: Path, ranks: int = 2, linger_s: float = 0.0, **fields: Any) -> PlacementRequest:
    return PlacementRequest(
        group="probe",
        ranks=ranks,
        command=["-c", RENDEZVOUS, str(tmp_path), str(linger_s)],
        env={"GROUP_SECRET": "s3cret", "OMP_NUM_THREADS": "1"},
        log_path=tmp_path / "ranks.log",
        **fields,
    )


def _nexrl_placement_groups() -> list[dict[str, Any]]:
    import ray

    return [
        group for group in ray.util.placement_group_table().values() if group["name"].startswith("nexrl-") and group["state"] != "REMOVED"
    ]


def _nexrl_actors() -> list[str]:
    import ray

    return [actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True) if actor["name"].startswith("nexrl-")]


def _wait_for(condition: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_two_ranks_land_on_both_nodes_meet_at_rank_zeros_node_and_leave_nothing_behind(ray_cluster: Any, tmp_path: Path) -> None:
    placer = _placer(ray_cluster)
    try:
        ranks = placer.place(_request(tmp_path, linger_s=60))
        places = ranks.places()
        assert [place.rank for place in places] == [0, 1]
        assert len({place.node for place in places}) == 2  # one CPU a node: one rank on each
        _wait_for(lambda: len(list(tmp_path.glob("rank*.json"))) == 2, 60)
        reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
        assert [report["sum"] for report in reports] == [3.0, 3.0]  # both joined one process group
        assert [report["RANK"] for report in reports] == ["0", "1"]
        assert {report["WORLD_SIZE"] for report in reports} == {"2"}
        assert {report["MASTER_ADDR"] for report in reports} == {places[0].address}
        assert [report["NEXRL_WORKER_IP"] for report in reports] == [place.address for place in places]
        assert {report["GROUP_SECRET"] for report in reports} == {"s3cret"}
        assert not ranks.ended()
        assert len(_nexrl_placement_groups()) == 1
        assert len(_nexrl_actors()) == 2
        ranks.stop(grace_s=0)
        for report in reports:
            with pytest.raises(ProcessLookupError):
                os.kill(report["pid"], 0)
        assert _nexrl_placement_groups() == [] and _nexrl_actors() == []
    finally:
        placer.close()


def test_a_rank_that_exits_ends_the_placement(ray_cluster: Any, tmp_path: Path) -> None:
    placer = _placer(ray_cluster)
    try:
        ranks = placer.place(_request(tmp_path, linger_s=60))
        _wait_for(lambda: len(list(tmp_path.glob("rank*.json"))) == 2, 60)
        assert not ranks.ended()
        os.kill(json.loads((tmp_path / "rank1.json").read_text())["pid"], signal.SIGKILL)
        _wait_for(ranks.ended, 20)
        ranks.stop(grace_s=0)
        assert _nexrl_placement_groups() == []
    finally:
        placer.close()


def test_a_group_the_cluster_has_no_room_for_is_refused_naming_what_is_free_and_leaves_nothing(ray_cluster: Any, tmp_path: Path) -> None:
    placer = _placer(ray_cluster, place_timeout_s=2)
    try:
        with pytest.raises(PlacementUnavailable) as refused:
            placer.place(_request(tmp_path, ranks=3))
        message = str(refused.value)
        assert "3 ranks of {CPU: 1}" in message and "CPU 2 of 2" in message
        assert _nexrl_placement_groups() == []
    finally:
        placer.close()


def test_strict_pack_refuses_what_no_single_node_holds(ray_cluster: Any, tmp_path: Path) -> None:
    placer = _placer(ray_cluster, strategy="STRICT_PACK", place_timeout_s=2)
    try:
        with pytest.raises(PlacementUnavailable, match="STRICT_PACK"):
            placer.place(_request(tmp_path))
        assert _nexrl_placement_groups() == []
    finally:
        placer.close()


def test_custom_resources_pin_every_rank_to_the_node_that_has_them(ray_cluster: Any, tmp_path: Path) -> None:
    import ray

    placer = _placer(ray_cluster, resources_per_rank={"nexrl_node_1": 1})
    try:
        ranks = placer.place(_request(tmp_path, ranks=1))
        node_1 = next(node["NodeID"] for node in ray.nodes() if node["Alive"] and "nexrl_node_1" in node["Resources"])
        assert [place.node for place in ranks.places()] == [node_1]
        ranks.stop()
    finally:
        placer.close()


def test_without_a_cluster_the_placer_says_how_to_start_one_at_once() -> None:
    import subprocess

    code = "from nexrl_core.plugins.registry import get_placer\nfrom nexrl_ray.options import RayPlacerOptions\nget_placer('ray', RayPlacerOptions(address='127.0.0.1:1'))\n"
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert time.monotonic() - started < 60
    assert result.returncode != 0
    assert "ray start --head" in result.stderr


def test_without_the_ray_plugin_a_service_refuses_the_placement_at_start_naming_the_extra(tmp_path: Path) -> None:
    import subprocess

    command = [
        str(Path(sys.executable).with_name("nexrl")),
        "serve",
        "tinker",
        "--port",
        "0",
        "--workers",
        "1",
        "--placement",
        "ray",
        "--data-dir",
        str(tmp_path),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**os.environ, "NEXRL_DISABLE_PLUGINS": "ray"})
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("nexrl serve tinker:")]
    assert "unknown placer 'ray'" in line and "pip install 'nexrl[ray]'" in line
