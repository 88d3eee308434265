"""Worker groups placed by Ray, driven by the unmodified tinker SDK through a local
Tinker service (``--workers 2 --placement ray``), on a real Ray cluster of three
one-CPU nodes on this machine: each group's two ranks land on two nodes.

- The curve is the in-process engine's: LoRA SFT steps on a Ray-placed group give the
  same losses as ``--workers 0``.
- A lost node (its raylet and everything on it killed) during a step is a lost group:
  it is rebuilt on the nodes that are left and the curve goes on as if nothing happened.
- SIGTERM to a service holding Ray groups ends it within 10 s, and the cluster keeps no
  NexRL placement group or actor.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

STEPS = 3
LORA_RANK = 4


@pytest.fixture(scope="module")
def cluster(ray_cluster: Any) -> Any:
    """The two-node cluster plus a spare node, where a group lost with its node is rebuilt."""
    ray_cluster.add_node(num_cpus=1, num_gpus=0, resources={"nexrl_node_2": 1})
    ray_cluster.wait_for_nodes()
    return ray_cluster


def _service(tmp_path: Path, cluster: Any | None, **overrides: Any) -> Any:
    from nexrl_tinker.testing import start_service

    placement = {} if cluster is None else {"placement": "ray", "placement_options": {"address": cluster.address}}
    return start_service(tmp_path, **({"workers": 2} if cluster is not None else {}), **placement, **overrides)


def _train(service: Any, lose_node_at: int | None = None, cluster: Any = None) -> dict[str, Any]:
    """STEPS LoRA SFT steps through the SDK, each step's loss; with ``lose_node_at``, a
    node holding one of the group's ranks (not the head, which holds the cluster's
    control store) is removed once that step's forward_backward is answered."""
    import tinker
    from tinker import types

    from nexrl_tinker.testing import BASE_MODEL, sft_data

    client = tinker.ServiceClient(base_url=service.base_url)
    training = client.create_lora_training_client(base_model=BASE_MODEL, rank=LORA_RANK, seed=3).result(timeout=300)
    data = sft_data(training.get_tokenizer())
    losses, places = [], None
    for step in range(STEPS):
        losses.append(training.forward_backward(data, "cross_entropy").result(timeout=300).metrics["loss:sum"])
        if service.settings.workers and places is None:
            places = service.state.engines.training(training.model_id).group.places()
        if step == lose_node_at:
            (victim,) = [node for node in cluster.worker_nodes if node.node_id in {place.node for place in places}][:1]
            cluster.remove_node(victim, allow_graceful=False)
            _wait_until_lost(service.state.engines.training(training.model_id).group)
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=300)
    losses.append(training.forward(data, "cross_entropy").result(timeout=300).metrics["loss:sum"])
    return {"model_id": training.model_id, "losses": losses, "places": places}


def _wait_until_lost(group: Any, timeout_s: float = 60) -> None:
    """Until the workers' API calls the group dead: the node's rank is gone (its actor died
    with the node's raylet, and the rank's watchdog ended it), so the step's next call meets
    a lost group instead of racing the node's last processes."""
    deadline = time.monotonic() + timeout_s
    while group.transport.info()["status"] == "ready":
        assert time.monotonic() < deadline, "the lost node's rank was never missed"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def in_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    service = _service(tmp_path_factory.mktemp("engine"), None)
    try:
        return _train(service)
    finally:
        service.stop()


def test_lora_sft_on_a_ray_placed_group_is_the_in_process_engines(cluster: Any, in_process: dict[str, Any], tmp_path: Path) -> None:
    service = _service(tmp_path, cluster)
    try:
        placed = _train(service)
    finally:
        service.stop()
    assert len({place.node for place in placed["places"]}) == 2, f"one rank a node: {placed['places']}"
    assert placed["losses"] == pytest.approx(in_process["losses"], abs=1e-4)
    assert in_process["losses"][-1] < in_process["losses"][0], f"the model did not learn: {in_process['losses']}"


def _nexrl_leftovers() -> tuple[list[str], list[str]]:
    import ray

    groups = [
        group["name"]
        for group in ray.util.placement_group_table().values()
        if group["name"].startswith("nexrl-") and group["state"] != "REMOVED"
    ]
    actors = [actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True) if actor["name"].startswith("nexrl-")]
    return groups, actors


def test_sigterm_to_a_service_holding_ray_groups_ends_it_and_leaves_the_cluster_clean(cluster: Any, tmp_path: Path) -> None:
    import ray
    import tinker

    from nexrl_tinker.testing import BASE_MODEL

    port_file = tmp_path / "log"
    with open(port_file, "wb") as log:
        server = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "nexrl"),
                "serve",
                "tinker",
                "--port",
                "0",
                "--workers",
                "2",
                "--placement",
                "ray",
                "--placement-option",
                f"address={cluster.address}",
                "--data-dir",
                str(tmp_path / "data"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        url = _served_url(port_file, server)
        training = tinker.ServiceClient(base_url=url).create_lora_training_client(base_model=BASE_MODEL, rank=LORA_RANK).result(timeout=300)
        assert training.model_id
        if not ray.is_initialized():
            ray.init(address=cluster.address)
        assert len(_nexrl_leftovers()[0]) == 1, "the model's group holds one placement group"
        started = time.monotonic()
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
        assert time.monotonic() - started < 10, port_file.read_text()[-3000:]
        deadline = time.monotonic() + 30
        while _nexrl_leftovers() != ([], []) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _nexrl_leftovers() == ([], [])
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _served_url(log: Path, server: subprocess.Popen[bytes], timeout_s: float = 180) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if " at http://" in line:
                return line.rsplit(" at ", 1)[1].split()[0]
        assert server.poll() is None, log.read_text()[-3000:]
        time.sleep(0.2)
    raise AssertionError(f"the service did not say where it serves: {log.read_text()[-3000:]}")


def test_a_lost_node_rebuilds_the_group_on_the_nodes_left_and_the_curve_goes_on(
    cluster: Any, in_process: dict[str, Any], tmp_path: Path
) -> None:
    """Last in the module: it takes a node away for good."""
    service = _service(tmp_path, cluster, worker_heartbeat_s=0.5, worker_dead_after_s=3.0, worker_save_every=1)
    try:
        healed = _train(service, lose_node_at=1, cluster=cluster)
        (restart,) = service.state.store.restarts_of(healed["model_id"])
        rebuilt = service.state.engines.training(healed["model_id"]).group.places()
    finally:
        service.stop()
    assert healed["losses"] == pytest.approx(in_process["losses"], abs=1e-4)
    # At least the acknowledged forward_backward; one more when the node went while the
    # previous optimizer step's restart point was still being saved (that save is lost too).
    assert restart.replayed >= 1, "the acknowledged forward_backward since the last restart point"
    alive = {node.node_id for node in [cluster.head_node, *cluster.worker_nodes]}
    assert {place.node for place in rebuilt} <= alive and len({place.node for place in rebuilt}) == 2
