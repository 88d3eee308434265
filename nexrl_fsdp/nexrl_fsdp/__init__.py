"""nexrl-fsdp: NexRL's self-hosted multi-process backend.

FSDP2 worker ranks under torchrun, driven over direct ZMQ (`direct_zmq`, `worker`), the
worker groups that the local services build per model (`worker_groups`), and the
``self-hosted`` backend with its sampler process. The single-device engine they shard
lives in ``nexrl_engine``; importing it first sets its OpenMP wait policy before any
submodule here loads torch.
"""

from __future__ import annotations

import nexrl_engine  # noqa: F401 - the engine's OpenMP wait policy, before torch loads

__version__ = "0.1.0"
