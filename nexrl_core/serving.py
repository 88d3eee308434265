"""What ``nexrl serve NAME`` and the embedded default of ``nexrl train`` ask of a service.

A service plugin registers a `ServiceSpec` whose factory takes `ServeOptions` and returns
a `Service`. The core starts it in the foreground for ``nexrl serve`` or in the
background for a training run, without knowing which web framework it uses.
"""

from __future__ import annotations

from typing import Protocol

import attrs

from nexrl_core.config.checks import service_device


class ServiceStartError(Exception):
    """A service cannot start with the options it was given (a port in use, a model that
    is not there): the message names the option and the fix, and nothing was left running."""

    def __init__(self, message: str, *, option: str | None = None, reason: str | None = None) -> None:
        """:param option: the `ServeOptions` field at fault (``device``), when it is one,
            so that whoever set it under another name (the embedded service's
            ``backend.options.device``) can name its own key.
        :param reason: the message without the command-line flag that names the option."""
        super().__init__(message)
        self.option = option
        self.reason = reason if reason is not None else message


@attrs.frozen(kw_only=True)
class ServeOptions:
    """Options every NexRL-run service understands."""

    host: str = "127.0.0.1"
    """Interface to bind; loopback unless told otherwise."""
    port: int = attrs.field(default=8000, validator=[attrs.validators.ge(0), attrs.validators.le(65535)])
    """TCP port; 0 picks a free one (see `Service.start`)."""
    db: str | None = None
    """SQLAlchemy URL of the state store; None lets the service choose a SQLite file."""
    model: str = "nexrl-tiny"
    """Base model served: a shipped model's name or a local HF directory."""
    dtype: str = attrs.field(default="fp32", validator=attrs.validators.in_(("fp32", "bf16")))
    """Precision the service trains and samples in (a recipe's ``model.dtype`` values);
    the service reports it, and a run whose ``model.dtype`` differs is refused."""
    device: str = attrs.field(default="cpu", validator=service_device)
    """Where the service's own engines (the training models trained in its process, and
    every sampler) live: ``cpu``, ``cuda`` or ``cuda:N``; a device this machine lacks
    is refused when the service starts."""
    api_key: str | None = None
    """When set, every request must carry this key."""
    data_dir: str | None = None
    """Where checkpoints and the default database live; None lets the service choose."""
    workers: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    """Ranks per training model: 0 trains every model in the service's own process; N
    gives each training model its own worker group of N processes (torchrun, FSDP)."""
    max_worker_groups: int = attrs.field(default=4, validator=attrs.validators.ge(1))
    """With ``workers``: most worker groups (training models) at once; one more is refused."""
    worker_save_every: int = attrs.field(default=10, validator=attrs.validators.ge(1))
    """With ``workers``: a group saves its model's whole training state every this many
    optimizer steps and journals the calls in between, which a restart replays."""
    separate_process: bool = False
    """Ask `Service.start` to serve from a child process instead of a thread of the caller
    (the embedded service of ``nexrl train`` does, so the server's Python work does not
    share one GIL with the training process). A service that cannot may ignore it;
    ``serve_forever`` always serves in the calling process."""


class Service(Protocol):
    """A server that can run in the foreground or in the background (a thread or a child process)."""

    def start(self) -> str:
        """Start serving in the background and return the base URL once it accepts requests."""
        ...

    def stop(self) -> None:
        """Stop serving and release everything (threads, child processes, sockets, database handles)."""
        ...

    def failure(self) -> str | None:
        """Why a started service stopped serving on its own (its process or thread died),
        in one line naming its log; None while it serves, before `start` and after `stop`."""
        ...

    def serve_forever(self) -> None:
        """Serve in the foreground until interrupted (Ctrl-C or SIGTERM)."""
        ...
