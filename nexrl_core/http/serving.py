"""What ``nexrl serve NAME`` and the embedded default of ``nexrl train`` ask of a service,
and how NexRL's HTTP apps start.

A service plugin registers a `ServiceSpec` whose factory takes `ServeOptions` and returns
a `Service`. The core starts it in the foreground for ``nexrl serve`` or in the
background for a training run, without knowing which web framework it uses.

Every HTTP app NexRL runs itself (the local services, the episode server, the workers'
API server) is an ASGI app on uvicorn, started the same way: `listen` binds the socket
first, so that port 0 gives a real port to report and a busy port fails at once with the
caller's own message instead of inside a server thread, and `UvicornServer` serves it
quietly from a background thread or in the foreground. uvicorn is imported only when a
server is built: it is the apps' dependency, not the core's.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import attrs

from nexrl_core.config.checks import service_device
from nexrl_core.fields import string_tuple

DEFAULT_MAX_TOKENS_PER_MICROBATCH = 16384
"""Most padded tokens (rows x longest row) one forward or forward/backward pass of an
engine takes by default. The one record of that default: the engine's own config and a
service's `ServeOptions` both read it here (the core may import no plugin, so it cannot sit
beside the engine), and a service left at its default packs the way any other engine does."""


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
    model_name: str | None = None
    """What clients call the model (``base_model``, ``model_name``): a Hugging Face-style
    ``Org/Name``, which tinker-cookbook's lookups and tokenizer downloads take; None: the
    shipped model's own such name, or the ``model`` path for a directory."""
    sampling_models: tuple[str, ...] = attrs.field(default=(), converter=string_tuple)
    """Models served beside ``model`` for sampling and scoring only, never trained (a
    distillation teacher): each a shipped name or a local Hugging Face directory with the
    base model's vocabulary. Clients name one as a ``base_model`` (the value given here,
    or its directory)."""
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
    placement: str | None = None
    """With ``workers``: the registered placer that starts each group's ranks (``nexrl
    plugins`` lists them); None: the service's own default, this machine."""
    placement_options: dict[str, Any] = attrs.field(factory=dict)
    """The placer's own options (structured into its config class when the service starts)."""
    worker_save_every: int = attrs.field(default=10, validator=attrs.validators.ge(1))
    """With ``workers``: a group saves its model's whole training state every this many
    optimizer steps and journals the calls in between, which a restart replays."""
    max_tokens_per_microbatch: int = attrs.field(default=DEFAULT_MAX_TOKENS_PER_MICROBATCH, validator=attrs.validators.ge(1))
    """Most padded tokens (rows x longest row) per forward or forward/backward pass of every
    engine the service builds (its training models, in its process or on worker groups, and
    its samplers); a larger batch runs in several passes. A smaller value bounds memory and
    changes nothing else: a step's loss and gradient are the same however it is split."""
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


def listen(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A non-blocking TCP socket listening on ``host:port`` (IPv6 when ``host`` has a ``:``).

    :raises OSError: when it cannot bind (the caller names its own option and fix).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio only sets TCP_NODELAY on accepted sockets whose proto
    # is TCP, and without it every response on a kept-alive connection waits ~40 ms for the
    # client's delayed ACK (Nagle).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


def base_url_of(sock: socket.socket) -> str:
    """``http://host:port`` of a listening socket, an IPv6 host in brackets."""
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


class UvicornServer:
    """An ASGI app on uvicorn over a socket from `listen`, which the caller keeps and closes.

    Quiet (warnings only, no access log, no lifespan events); ``options`` are further
    ``uvicorn.Config`` fields (keep-alive and graceful-shutdown timeouts). ``on_shutdown``
    runs as uvicorn begins its shutdown, before it waits for open requests (a service
    answers its open long-polls there).
    """

    def __init__(self, app: Any, sock: socket.socket, *, name: str, on_shutdown: Callable[[], None] | None = None, **options: Any) -> None:
        """:param name: the server thread's name."""
        import uvicorn

        class _Server(uvicorn.Server):
            async def shutdown(self, sockets: Any = None) -> None:
                if on_shutdown is not None:
                    on_shutdown()
                await super().shutdown(sockets=sockets)

        self.sock = sock
        self.name = name
        self._server = _Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", **options))
        self._thread: threading.Thread | None = None

    def start(self, what: str, timeout_s: float) -> None:
        """Serve from a daemon thread; return once it accepts connections.

        :param what: the server as messages name it (``"the episode server"``).
        :raises RuntimeError: when the thread fails or does not start within ``timeout_s``
            (the thread has been stopped; the socket is still the caller's to close).
        """
        errors: list[BaseException] = []

        def run() -> None:
            try:
                self._server.run(sockets=[self.sock])
            except BaseException as exc:  # noqa: BLE001 - reported by start()
                errors.append(exc)

        self._thread = threading.Thread(target=run, name=self.name, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if errors or not self._thread.is_alive():
                self.stop()
                raise RuntimeError(f"{what} failed to start: {errors[0] if errors else 'server thread exited'}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{what} did not start within {timeout_s:g} s")
            time.sleep(0.01)

    def run(self) -> None:
        """Serve in the calling thread until uvicorn exits (Ctrl-C, SIGTERM or `stop`)."""
        self._server.run(sockets=[self.sock])

    def stop(self, timeout_s: float = 30) -> None:
        """Ask uvicorn to exit and wait up to ``timeout_s`` for the server thread."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            self._thread = None

    def thread_died(self) -> bool:
        """Whether `start`'s thread ended on its own (a server `stop` ended has none)."""
        return self._thread is not None and not self._thread.is_alive()
