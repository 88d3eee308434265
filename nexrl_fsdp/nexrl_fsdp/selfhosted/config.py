"""Options of the ``self-hosted`` backend; light to import (no torch)."""

from __future__ import annotations

from typing import Any

import attrs

from nexrl_core.config.checks import non_empty, optional_non_empty, positive
from nexrl_core.training.placement import LOCAL_PLACEMENT
from nexrl_core.training.self_hosted import UpdateSettings
from nexrl_engine.batching import BatchedSamplingOptions, positive_int

__all__ = ["SamplerOptions", "SelfHostedBackendConfig"]


@attrs.frozen(kw_only=True)
class SamplerOptions(BatchedSamplingOptions):
    """The sampler process rollouts sample from: its device and how it batches concurrent requests."""

    device: str = attrs.field(default="cpu", validator=non_empty)
    """torch device of the sampler: ``cpu``, ``cuda``, ``cuda:1``, ..."""


@attrs.frozen(kw_only=True)
class SelfHostedBackendConfig:
    """``backend.options`` of the ``self-hosted`` backend."""

    world_size: int = attrs.field(default=2, validator=positive_int)
    """Worker ranks. With ``workers_url`` null the run starts them where ``placement``
    puts them (gloo on CPU, NCCL on GPUs)."""
    placement: str = attrs.field(default=LOCAL_PLACEMENT, validator=non_empty)
    """The registered placer that starts the ranks (``workers_url`` null): ``local`` puts
    them on this machine, every socket on 127.0.0.1 (`nexrl_fsdp.worker.loopback`);
    ``ray`` (nexrl-ray) on a Ray cluster; ``nexrl plugins`` lists what is installed."""
    placement_options: dict[str, Any] = attrs.field(factory=dict)
    """The placer's own options (``ray``: ``address``, ``strategy``, ``place_timeout_s``,
    ``resources_per_rank``)."""
    workers_url: str | None = attrs.field(default=None, validator=optional_non_empty)
    """URL of a workers API server (``nexrl serve workers``) whose ``world_size`` ranks
    were started elsewhere (several machines, Kubernetes); null starts both here."""
    identifier: str = attrs.field(default="actor", validator=non_empty)
    """The worker group's name on the API server (``--identifier`` of the workers)."""
    teacher_world_size: int | None = attrs.field(default=None, validator=attrs.validators.optional(positive_int))
    """Ranks of the teacher's own group (identifier ``teacher``, on the student's API
    server), started when the recipe sets ``teacher.model``; null: ``world_size``."""
    trainer: str = attrs.field(default="self_hosted_grpo", validator=non_empty)
    """Registered trainer with capability ``transport``."""
    update: UpdateSettings = attrs.field(factory=UpdateSettings)
    """PPO epochs, mini-batches and micro-batch rows of each update on the workers."""
    recompute_old_logprobs: bool | None = None
    """Recompute the behaviour logprobs on the workers before each update; null keeps
    the trainer's default (``self_hosted_grpo``: true)."""
    sampler: SamplerOptions = attrs.field(factory=SamplerOptions)
    connect_timeout_s: float = attrs.field(default=180.0, validator=positive)
    """How long to wait for every rank to report itself."""
    op_timeout_s: float = attrs.field(default=600.0, validator=positive)
    """How long one op on the workers may take."""
    heartbeat_s: float = attrs.field(default=5.0, validator=positive)
    """How often each local rank beats (``workers_url`` null)."""
    dead_after_s: float = attrs.field(default=15.0, validator=positive)
    """A local group whose ranks stop beating this long is dead: it is restarted (see
    ``max_restarts``)."""
    max_restarts: int = attrs.field(default=3, validator=attrs.validators.ge(0))
    """How often a local group that lost a rank (or passed ``op_timeout_s`` in an op) is
    stopped, started afresh and loaded from the last complete checkpoint, the steps after
    it run again; past this (or with 0, or a ``workers_url`` group) the run stops with
    the command that resumes it."""
