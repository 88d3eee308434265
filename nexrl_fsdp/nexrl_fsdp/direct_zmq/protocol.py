"""What the driver, the API server and the workers agree on: op names, batch fields, env vars.

Light to import (no torch, no zmq), so the API server and configs can use it anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping

from nexrl_core.training.placement import ENV_RANK_ADDRESS

__all__ = [
    "BATCH_OPS",
    "DATUM_OPS",
    "BATCH_TENSORS",
    "ENV_COLLECTIVE_TIMEOUT",
    "ENV_DATA_BASE_PORT",
    "ENV_HEARTBEAT_INTERVAL",
    "ENV_STORE_FD",
    "ENV_WORKER_IP",
    "OPS",
    "OPTIONAL_BATCH_TENSORS",
]

OPS = (
    "init_model",
    "update_actor",
    "compute_log_prob",
    "compute_ref_log_prob",
    "get_weights",
    "push_weights",
    "save_checkpoint",
    "load_checkpoint",
    "export_hf",
    "forward",
    "optim_step",
    "save_state",
    "load_state",
    "barrier",
    "destroy",
)
"""Every op a worker group runs; each is one "execute" broadcast."""

DATUM_OPS = frozenset({"forward"})
"""Ops that carry Tinker-shaped datums (`nexrl_fsdp.direct_zmq.datums`), which every rank
receives whole and splits itself (see `nexrl_fsdp.worker.datum_ops`)."""

BATCH_OPS = frozenset({"update_actor", "compute_log_prob", "compute_ref_log_prob"})
"""Ops that carry a batch, scattered by rows over the ranks."""

BATCH_TENSORS: Mapping[str, str] = {
    "input_ids": "int64",
    "attention_mask": "int64",
}
"""[B, L] tensors every batch op needs, with the dtype each must have."""

OPTIONAL_BATCH_TENSORS: Mapping[str, str] = {
    "loss_mask": "float32",
    "old_logprobs": "float32",
    "advantages": "float32",
    "ref_logprobs": "float32",
}
"""[B, L] tensors a loss may need (``update_actor`` checks the loss's ``requires``)."""

ENV_WORKER_IP = ENV_RANK_ADDRESS
"""Address a worker binds its data socket on and reports (every placer sets it; by hand:
default 127.0.0.1, a pod IP on Kubernetes)."""
ENV_DATA_BASE_PORT = "NEXRL_WORKER_DATA_BASE_PORT"
"""Rank r binds its data socket on this port + r; unset or 0: a free port each."""
ENV_HEARTBEAT_INTERVAL = "NEXRL_WORKER_HEARTBEAT_S"
"""Seconds between a worker's heartbeats (default 5)."""
ENV_COLLECTIVE_TIMEOUT = "NEXRL_WORKER_COLLECTIVE_TIMEOUT_S"
"""torch.distributed timeout of the worker group's collectives (default 600)."""
ENV_STORE_FD = "NEXRL_WORKER_STORE_FD"
"""Set by the loopback launcher on every rank (`nexrl_fsdp.worker.loopback`): the ranks
build the process group's TCPStore themselves, rank 0 serving it on this inherited
descriptor (a socket bound on 127.0.0.1), the others connecting to MASTER_ADDR:MASTER_PORT."""
