"""`WeightsInbox`: the socket a ``--workers`` service opens in its own process for the
duration of a weights push, the one listener of a local run that no snapshot of a plain
group's or a self-hosted run's sockets sees."""

from __future__ import annotations

import os
from typing import Any

import torch
import zmq

from nexrl_fsdp.direct_zmq.group_key import new_group_key
from nexrl_fsdp.direct_zmq.weights_inbox import WeightsInbox
from nexrl_fsdp.worker.weights_push import push_weights
from nexrl_testing.processes import tcp_listeners


def test_the_inbox_listens_on_the_loopback_only_while_weights_arrive() -> None:
    """Read while rank 0's push is being loaded: every socket on the inbox's port is on
    127.0.0.1, so nothing of a local run is reachable from another machine."""
    weights = {"layer.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    seen: dict[str, Any] = {}

    def load(received: dict[str, torch.Tensor]) -> str:
        seen["listeners"] = [(address, port) for _, address, port in tcp_listeners([os.getpid()]) if port == inbox_port]
        seen["weights"] = {name: tensor.clone() for name, tensor in received.items()}
        return "loaded"

    key = new_group_key()
    with WeightsInbox(load, key=key) as inbox:
        inbox_port = int(inbox.endpoint.rsplit(":", 1)[1])
        context = zmq.Context()
        try:
            push_weights(context, inbox.endpoint, weights, "push-1", timeout_s=30, key=key)
        finally:
            context.term()
        assert inbox.loaded() == "loaded"
    assert seen["listeners"] == [("127.0.0.1", inbox_port)], seen["listeners"]
    assert torch.equal(seen["weights"]["layer.weight"], weights["layer.weight"])
