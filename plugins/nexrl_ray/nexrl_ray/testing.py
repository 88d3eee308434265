"""A real two-node Ray cluster on this machine, for tests of anything placed on Ray.

Each node has one CPU and a custom resource of its own (``nexrl_node_0``,
``nexrl_node_1``), so a group of two one-CPU ranks lands one rank on each node, and a
test can pin work to a node. ``ray.cluster_utils.Cluster`` starts a GCS and a raylet per
node as separate processes, as ``ray start`` does on separate machines.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

__all__ = ["NODE_RESOURCE", "ray_cluster"]

NODE_RESOURCE = "nexrl_node_{}"


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """Two Ray nodes of one CPU each, this process connected to them; torn down after the module."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "num_gpus": 0, "resources": {NODE_RESOURCE.format(0): 1}, "include_dashboard": False},
    )
    try:
        cluster.add_node(num_cpus=1, num_gpus=0, resources={NODE_RESOURCE.format(1): 1})
        cluster.wait_for_nodes()
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
