"""A local service's settings: the core's `ServeOptions` plus the runtime's own knobs.

Kept in one frozen record so every module reads the same values, and so tests can
shorten the long-poll or the retention times without touching module globals. The
``name`` of the protocol picks the defaults that must not collide between services
run side by side: the data directory ``~/.nexrl/<name>`` and the database
``<name>.db`` in it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs

from nexrl_core.http.serving import DEFAULT_MAX_TOKENS_PER_MICROBATCH, ServeOptions, ServiceStartError
from nexrl_service.hub import hub_name_problem

__all__ = ["ServerSettings", "default_data_dir"]


def default_data_dir(name: str) -> Path:
    """``$NEXRL_HOME/<name>``, else ``~/.nexrl/<name>``."""
    home = os.environ.get("NEXRL_HOME")
    return (Path(home) if home else Path.home() / ".nexrl") / name


def _path(value: str | Path) -> Path:
    return Path(value).expanduser()


@attrs.frozen(kw_only=True)
class ServerSettings:
    name: str = "service"
    """The protocol's short name: default data directory and database file."""
    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: Path = attrs.field(default=attrs.Factory(lambda self: default_data_dir(self.name), takes_self=True), converter=_path)
    db_url: str = ""
    """SQLAlchemy URL; empty means ``sqlite:///<data_dir>/<name>.db``."""
    model: str = "nexrl-tiny"
    """The one base model served: a shipped name or a local HF directory."""
    model_name: str | None = None
    """What clients call it (`nexrl_core.http.serving.ServeOptions.model_name`)."""
    sampling_models: tuple[str, ...] = ()
    """Served for sampling and scoring only (`nexrl_core.http.serving.ServeOptions.sampling_models`)."""
    dtype: str = "fp32"
    """Precision of every engine the service builds (``fp32`` or ``bf16``)."""
    device: str = "cpu"
    """Where every engine the service builds in its own process lives (``cpu``, ``cuda``,
    ``cuda:N``): the training models without worker groups, and every sampler."""
    max_tokens_per_microbatch: int = DEFAULT_MAX_TOKENS_PER_MICROBATCH
    """Most padded tokens per forward or forward/backward pass of every engine the service
    builds: the training models (in this process or on worker groups) and every sampler."""
    api_key: str | None = None
    long_poll_s: float = 30.0
    """How long a poll for a future's outcome is held before the protocol answers "not
    yet"; below the clients' own HTTP timeouts (45 s is common)."""
    submit_wait_s: float = 2.0
    """How long a protocol whose submissions may already carry the result (Weaver's
    operation envelopes) waits for it before answering "pending": a quick operation
    then costs no poll. Well below the clients' HTTP timeouts, since a client re-sends
    a request whose answer does not come in time."""
    stale_session_s: float = 24 * 3600.0
    """A session without a heartbeat for this long is expired and its resources released."""
    fetched_retention_s: float = 600.0
    """How long a fetched result stays retrievable (the SDK may poll again after a timeout)."""
    unfetched_retention_s: float = 24 * 3600.0
    janitor_interval_s: float = 300.0
    gap_timeout_s: float = 120.0
    """A model's queue waits this long for a missing sequence number before skipping it."""
    compute_threads: int = 1
    """Threads that run engine calls (one lane's job at a time each). One by default: torch
    gives every calling thread its own OpenMP team, and several teams on a few cores made
    each call up to 20 % slower than queueing them on one thread; more only pay off with
    several devices to keep busy."""
    batch_linger_s: float = 0.008
    """While sampling is bursty, an idle sampling lane that receives a batchable request
    waits until no other request has arrived for this long (at most `batch_linger_max_s`)
    before starting, so a burst of an RL step's requests runs as one engine call, not as
    a lone first request followed by the rest (see `scheduler`). 0 starts at once."""
    batch_linger_max_s: float = 0.1
    workers: int = 0
    """Ranks per training model: 0 trains every model on an engine in this process, N
    gives each its own worker group of N processes (`nexrl_core.training.worker_groups`)."""
    max_worker_groups: int = 4
    """With ``workers``: most worker groups at once; creating one more model is refused."""
    placement: str | None = None
    """With ``workers``: the registered placer of each group's ranks; None: this machine."""
    placement_options: dict[str, Any] = attrs.field(factory=dict)
    worker_heartbeat_s: float = 5.0
    worker_dead_after_s: float = 15.0
    """A group whose ranks stop beating this long is lost and restarted (`nexrl_core.training.worker_groups`)."""
    worker_op_timeout_s: float = 600.0
    """A group op running longer is taken for a hung group and restarted."""
    worker_save_every: int = 10
    """A group model saves its restart point every this many optimizer steps and journals
    the calls in between (`nexrl_core.training.worker_groups.GroupSettings.save_every`)."""
    worker_max_restarts: int = 3
    """Restarts of a model's group one request may cause before it fails."""
    sampler_cache_size: int = 4
    """Sampling engines kept in memory (least recently used goes first)."""
    ephemeral_keep: int = 8
    """Ephemeral sampler snapshots kept on disk per training model."""
    max_body_bytes: int = 512 * 1024 * 1024
    """Largest accepted request body after decompression."""
    download_url_ttl_s: float = 3600.0
    """How long a signed download URL of a checkpoint's file stays valid."""

    @property
    def database_url(self) -> str:
        return self.db_url or f"sqlite:///{self.data_dir / f'{self.name}.db'}"

    @classmethod
    def from_options(cls, options: ServeOptions, name: str, **overrides: object) -> ServerSettings:
        data_dir = Path(options.data_dir).expanduser() if options.data_dir else default_data_dir(name)
        values: dict[str, object] = {
            "name": name,
            "host": options.host,
            "port": options.port,
            "data_dir": data_dir,
            "db_url": options.db or "",
            "model": options.model,
            "model_name": options.model_name,
            "sampling_models": tuple(options.sampling_models),
            "dtype": options.dtype,
            "device": options.device,
            "max_tokens_per_microbatch": options.max_tokens_per_microbatch,
            "api_key": options.api_key or None,
            "workers": options.workers,
            "max_worker_groups": options.max_worker_groups,
            "placement": options.placement,
            "placement_options": dict(options.placement_options),
            "worker_save_every": options.worker_save_every,
        }
        if options.model_name is not None and (problem := hub_name_problem(options.model_name)) is not None:
            reason = f"{problem}; give a name such as myorg/{Path(options.model).name or 'my-model'}"
            raise ServiceStartError(f"--model-name {reason}", option="model_name", reason=reason)
        if (options.placement is not None or options.placement_options) and not options.workers:
            raise ServiceStartError("--placement places the ranks of worker groups; give --workers N as well, or leave it out")
        if options.workers:
            # A compute thread waits on each group's calls; one more samples.
            values["compute_threads"] = options.max_worker_groups + 1
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]
