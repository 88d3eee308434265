"""`LocalService`: the core's `Service` protocol over uvicorn, for any protocol's app.

A protocol subclasses it, names itself (``name``, ``title``) and supplies
``create_app(state)``, its FastAPI routes over a started `ServiceState`; everything
else is here. ``start()`` serves from a background thread (the tests), or, with
``ServeOptions(separate_process=True)``, from a child process (the embedded default of
``nexrl train``: the server's Python work then no longer shares one GIL with the
training process's SDK client threads); ``serve_forever()`` serves in the foreground
(``nexrl serve <name>``) and stops cleanly on Ctrl-C or SIGTERM. The listening socket
is bound before uvicorn starts (in the parent, and handed to a child process), so port
0 gives a real port to report and a busy port fails in ``start()`` with a clear error
instead of inside a thread or a child. A child process is ``python -m
nexrl_service.server``; it rebuilds the same subclass from its import path.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import IO, Any

import attrs

import nexrl_engine  # noqa: F401 - sets the OpenMP wait policy before anything loads torch
from nexrl_core.http.serving import ServeOptions, ServiceStartError, UvicornServer, base_url_of, listen
from nexrl_core.longlived import freeze_long_lived_objects
from nexrl_service.settings import ServerSettings
from nexrl_service.tombstone import Tombstone

__all__ = ["LocalService"]

log = logging.getLogger("nexrl_service")

# How a child-process server learns what to serve (see `LocalService._start_child`).
_CLASS_ENV = "NEXRL_SERVICE_CLASS"
_SETTINGS_ENV = "NEXRL_SERVICE_SETTINGS"
_LISTEN_FD_ENV = "NEXRL_SERVICE_LISTEN_FD"
_PARENT_PID_ENV = "NEXRL_PARENT_PID"
_CHILD_LOG = "server.log"
_WATCH_INTERVAL_S = 0.5
"""How often the parent checks that its serving child is alive."""
_CHILD_START_TIMEOUT_S = 120.0
_CHILD_STOP_TIMEOUT_S = 15.0


def _ignore_replayed_sigterm(_signum: int, _frame: Any) -> None:
    """uvicorn handles SIGTERM itself, then replays it to the previous handler once it has
    shut down; this handler lets ``serve_forever`` return and clean up instead of dying."""


class LocalService:
    """A local service on the runtime; subclasses supply the protocol."""

    name = "service"
    """Short name: default data directory and database, thread names."""
    title = "NexRL service"
    background_answers: Mapping[str, Mapping[str, Any]] = {}
    """Route -> answer for what the protocol's clients post in the background (telemetry),
    which a dead child's `Tombstone` accepts instead of refusing."""
    """How logs and the console name it."""
    health_path = "/api/v1/healthz"
    """A route of the protocol's app that answers 200 once it serves (waited on for a child)."""
    serves_sampling_models = False
    """Whether the protocol's routes sample from ``--sampling-model`` models
    (`nexrl_core.http.serving.ServeOptions.sampling_models`); a service whose routes do not
    refuses them when it is built."""

    def __init__(
        self,
        options: ServeOptions | ServerSettings | None = None,
        *,
        separate_process: bool | None = None,
        **overrides: Any,
    ) -> None:
        if options is None:
            options = ServeOptions()
        if isinstance(options, ServeOptions):
            self.settings = ServerSettings.from_options(options, self.name, **overrides)
            default_separate = options.separate_process
        else:
            self.settings = options
            default_separate = False
        if self.settings.sampling_models and not self.serves_sampling_models:
            reason = f"the {self.title} samples and scores with no model but the one it trains, so it holds no teacher"
            raise ServiceStartError(f"--sampling-model: {reason}; leave it out", option="sampling_models", reason=reason)
        self.separate_process = default_separate if separate_process is None else separate_process
        """`start()` serves from a child process instead of a thread."""
        self.state: Any = None
        """The in-process `ServiceState` (None while serving from a child process)."""
        self._server: UvicornServer | None = None
        self._socket: socket.socket | None = None
        self._listen_fd: int | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._process_log: IO[bytes] | None = None
        self._process_log_start = 0
        self._child_socket: socket.socket | None = None
        """The listening socket the child serves on; kept to answer for a dead child."""
        self._tombstone: Tombstone | None = None
        self._watcher: threading.Thread | None = None
        self._stopping = threading.Event()
        """Set by stop(): the watcher ends at once instead of taking the child's end for a death."""
        self.base_url: str | None = None

    def create_app(self, state: Any) -> Any:
        """The protocol's FastAPI app over a started `ServiceState`."""
        raise NotImplementedError

    @property
    def pid(self) -> int | None:
        """The child process's id while serving from one, else None."""
        return self._process.pid if self._process is not None else None

    def _listen(self) -> socket.socket:
        if self._listen_fd is not None:  # a child process: the parent bound it
            sock = socket.socket(fileno=self._listen_fd)
            self._listen_fd = None
            sock.setblocking(False)
            return sock
        return self._bind()

    def _bind(self) -> socket.socket:
        try:
            return listen(self.settings.host, self.settings.port)
        except OSError as exc:
            raise ServiceStartError(
                f"--port/--host: cannot listen on {self.settings.host}:{self.settings.port} ({exc.strerror or exc}); "
                "choose a free port, or 0 for any free one"
            ) from None

    def _prepare(self) -> UvicornServer:
        from nexrl_service.state import ServiceState

        self._check_device()
        self._socket = self._listen()
        try:
            try:
                self.state = ServiceState(self.settings)
            except ValueError as exc:  # the settings: a model that is not there, a bad database URL
                raise ServiceStartError(str(exc)) from None
            self.state.start()
            app = self.create_app(self.state)
        except BaseException:
            self._socket.close()
            if self.state is not None:
                self.state.close()
                self.state = None
            raise
        self.base_url = base_url_of(self._socket)
        self._server = UvicornServer(
            app,
            self._socket,
            name=f"{self.name}-uvicorn",
            # Answer open long-polls ("not yet") at once, not after the grace period.
            on_shutdown=self.state.book.close,
            timeout_keep_alive=75,
            timeout_graceful_shutdown=5,
        )
        return self._server

    def _check_model(self) -> None:
        from nexrl_engine.loading import check_chat_model_dir, resolve_model_dir

        try:
            check_chat_model_dir(resolve_model_dir(self.settings.model))
        except ValueError as exc:
            raise ServiceStartError(str(exc)) from None
        from nexrl_service.engines import BaseModelInfo

        base = BaseModelInfo.load(self.settings.model)
        for model in self.settings.sampling_models:
            try:
                base.sampling_model(model)
            except ValueError as exc:
                raise ServiceStartError(f"--sampling-model {exc}", option="sampling_models", reason=str(exc)) from None

    def _check_device(self) -> None:
        """The device the engines are to live on is one this machine has.

        :raises ServiceStartError: naming ``--device`` (``option="device"``) and what to do.
        """
        from nexrl_engine.recipe_checks import device_problem

        problem = device_problem(self.settings.device)
        if problem is not None:
            raise ServiceStartError(f"--device: {problem}", option="device", reason=problem)

    def start(self) -> str:
        if self._server is not None or self._process is not None:
            raise RuntimeError(f"{type(self).__name__} is already running")
        if self.separate_process:
            # here, so a bad model or device is a clear error and not a dead child's log
            self._check_device()
            self._check_model()
            return self._start_child()
        server = self._prepare()
        try:
            server.start(self.title, timeout_s=60)
        except RuntimeError:
            self.stop()
            raise
        log.info("%s serving %s at %s", self.title, self.settings.model, self.base_url)
        assert self.base_url is not None
        return self.base_url

    def _start_child(self) -> str:
        """Serve from ``python -m nexrl_service.server`` on a socket bound here."""
        sock = self._bind()
        try:
            base_url = self.base_url = base_url_of(sock)
            values = attrs.asdict(self.settings)
            values["data_dir"] = str(self.settings.data_dir)
            values["port"] = sock.getsockname()[1]
            self.settings.data_dir.mkdir(parents=True, exist_ok=True)
            self._process_log = open(self.settings.data_dir / _CHILD_LOG, "ab")  # noqa: SIM115 - closed by stop()
            self._process_log_start = self._process_log.tell()
            env = dict(os.environ)
            env[_CLASS_ENV] = f"{type(self).__module__}:{type(self).__qualname__}"
            env[_SETTINGS_ENV] = json.dumps(values)
            env[_LISTEN_FD_ENV] = str(sock.fileno())
            env[_PARENT_PID_ENV] = str(os.getpid())
            self._process = subprocess.Popen(
                [sys.executable, "-m", "nexrl_service.server"],
                stdin=subprocess.DEVNULL,
                stdout=self._process_log,
                stderr=subprocess.STDOUT,
                env=env,
                pass_fds=(sock.fileno(),),
                # Out of the terminal's process group: Ctrl-C reaches the parent, whose
                # stop() then ends the child in order.
                start_new_session=True,
            )
        except BaseException:
            sock.close()
            self.stop()
            raise
        self._child_socket = sock  # the child accepts on it; kept to answer for the child once it dies
        try:
            self._wait_child_healthy(base_url)
        except BaseException:
            self.stop()
            raise
        log.info("%s serving %s at %s (process %d)", self.title, self.settings.model, base_url, self._process.pid)
        self._stopping.clear()
        self._watcher = threading.Thread(target=self._watch_child, args=(self._process,), daemon=True, name=f"{self.name}-watch")
        self._watcher.start()
        return base_url

    def _watch_child(self, process: subprocess.Popen[bytes]) -> None:
        """Once the child dies on its own, answer for it (`Tombstone`) so clients stop
        retrying, and log why once."""
        while process.poll() is None:
            if self._stopping.wait(_WATCH_INTERVAL_S):
                return
        sock = self._child_socket
        if self._stopping.is_set() or sock is None:  # stopped on purpose
            return
        reason = self.failure() or f"{self.title} stopped"
        log.error("%s; every request is now refused with 410", reason)
        self._tombstone = Tombstone(sock, f"{reason}; start it again (a run: nexrl train ... --resume)", accepted=self.background_answers)

    def _child_log_tail(self, limit: int = 4000) -> str:
        try:
            with open(self.settings.data_dir / _CHILD_LOG, "rb") as f:
                f.seek(self._process_log_start)
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return ""
        return text[-limit:].strip()

    def _wait_child_healthy(self, base_url: str) -> None:
        import http.client
        from urllib.parse import urlsplit

        parts = urlsplit(base_url)
        assert parts.hostname is not None, base_url  # `base_url_of` the socket this service bound
        assert self._process is not None
        deadline = time.monotonic() + _CHILD_START_TIMEOUT_S
        while True:
            code = self._process.poll()
            if code is not None:
                raise RuntimeError(
                    f"{self.title} failed to start: its process exited with status {code}; "
                    f"last output ({self.settings.data_dir / _CHILD_LOG}):\n{self._child_log_tail()}"
                )
            try:
                conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=2.0)
                try:
                    conn.request("GET", self.health_path)
                    if conn.getresponse().status == 200:
                        return
                finally:
                    conn.close()
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self.title} did not start within {_CHILD_START_TIMEOUT_S:.0f} s; last output "
                    f"({self.settings.data_dir / _CHILD_LOG}):\n{self._child_log_tail()}"
                )
            time.sleep(0.05)

    def _stop_child(self) -> None:
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join()
            self._watcher = None
        if self._tombstone is not None:
            self._tombstone.close()
            self._tombstone = None
        if self._child_socket is not None:
            self._child_socket.close()
            self._child_socket = None
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=_CHILD_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning("%s process %d ignored SIGTERM for %.0f s; killing it", self.title, process.pid, _CHILD_STOP_TIMEOUT_S)
                process.kill()
                process.wait()
        if self._process_log is not None:
            self._process_log.close()
            self._process_log = None

    def failure(self) -> str | None:
        if self._process is not None:
            code = self._process.poll()
            if code is not None:
                return (
                    f"{self.title} (pid {self._process.pid}) died (exit status {code}; its output: {self.settings.data_dir / _CHILD_LOG})"
                )
        elif self._server is not None and self._server.thread_died():
            return f"{self.title} stopped serving: its server thread exited"
        return None

    def stop(self) -> None:
        self._stop_child()
        if self._server is not None:
            self._server.stop(timeout_s=30)
        self._server = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        if self.state is not None:
            self.state.close()
            self.state = None

    def serve_forever(self) -> None:
        server = self._prepare()
        freeze_long_lived_objects()  # this process is the server's own: models and imports are loaded
        print(
            f"{self.title} serving {self.settings.model} ({self.settings.dtype} on {self.settings.device}) at {self.base_url} "
            f"(data: {self.settings.data_dir}, db: {self.state.store.url})",
            file=sys.stderr,
            flush=True,
        )
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, _ignore_replayed_sigterm)
        try:
            server.run()
        except (KeyboardInterrupt, SystemExit):
            pass
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            self._server = None
            self.stop()

    def __enter__(self) -> LocalService:  # noqa: PYI034 (Self needs Python 3.11)
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _watch_parent(parent_pid: int) -> None:
    """End this (child) server when the process that started it is gone: SIGTERM to
    ourselves for uvicorn's graceful shutdown, then a hard exit if that hangs."""
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    log.warning("parent process %d is gone; shutting down", parent_pid)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(_CHILD_STOP_TIMEOUT_S)
    os._exit(1)


def _child_main() -> None:
    """``python -m nexrl_service.server``: the child process of a
    ``LocalService(separate_process=True)``; everything comes from the environment."""
    module, _, qualname = os.environ.pop(_CLASS_ENV).partition(":")
    service_class = getattr(importlib.import_module(module), qualname)
    values = json.loads(os.environ.pop(_SETTINGS_ENV))
    fd = int(os.environ.pop(_LISTEN_FD_ENV))
    parent = os.environ.pop(_PARENT_PID_ENV, None)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if parent is not None:
        threading.Thread(target=_watch_parent, args=(int(parent),), name="parent-watch", daemon=True).start()
    service = service_class(ServerSettings(**values))
    service._listen_fd = fd
    service.serve_forever()


if __name__ == "__main__":
    _child_main()
