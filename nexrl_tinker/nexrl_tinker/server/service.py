"""`TinkerService`: the core's `Service` protocol over uvicorn.

``start()`` serves from a background thread (the embedded default of ``nexrl train``
and the tests); ``serve_forever()`` serves in the foreground (``nexrl serve tinker``)
and stops cleanly on Ctrl-C or SIGTERM. The listening socket is bound before uvicorn
starts, so port 0 gives a real port to report and a busy port fails in ``start()``
with a clear error instead of inside a thread.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

# Before torch loads: OpenMP threads that spin while waiting make a 2-thread torch op
# up to 100x slower as soon as another process (or another compute thread of this
# server) holds a core; passive waiting costs nothing measurable here. Only a default.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from nexrl_core.serving import ServeOptions
from nexrl_tinker.server.settings import ServerSettings

__all__ = ["TinkerService"]

log = logging.getLogger("nexrl_tinker.server")


def _ignore_replayed_sigterm(_signum: int, _frame: Any) -> None:
    """uvicorn handles SIGTERM itself, then replays it to the previous handler once it has
    shut down; this handler lets ``serve_forever`` return and clean up instead of dying."""


class TinkerService:
    """The local Tinker-compatible service ("TinkerCloud")."""

    def __init__(self, options: ServeOptions | ServerSettings | None = None, **overrides: Any) -> None:
        if options is None:
            options = ServeOptions()
        if isinstance(options, ServeOptions):
            self.settings = ServerSettings.from_options(options, **overrides)
        else:
            self.settings = options
        self.cloud: Any = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None
        self.base_url: str | None = None

    def _bind(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.settings.host else socket.AF_INET
        # IPPROTO_TCP explicitly: asyncio only sets TCP_NODELAY on accepted sockets whose
        # proto is TCP, and without it every response on a kept-alive connection waits
        # ~40 ms for the client's delayed ACK (Nagle).
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.settings.host, self.settings.port))
        except OSError as exc:
            sock.close()
            raise RuntimeError(f"cannot listen on {self.settings.host}:{self.settings.port}: {exc}") from exc
        sock.listen(2048)
        sock.setblocking(False)
        return sock

    def _prepare(self) -> Any:
        import uvicorn

        from nexrl_tinker.server.app import create_app
        from nexrl_tinker.server.cloud import Cloud

        self._socket = self._bind()
        try:
            self.cloud = Cloud(self.settings)
            self.cloud.start()
            app = create_app(self.cloud)
        except BaseException:
            self._socket.close()
            if self.cloud is not None:
                self.cloud.close()
                self.cloud = None
            raise
        host, port = self._socket.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        self.base_url = f"http://{shown}:{port}"
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_keep_alive=75,
            timeout_graceful_shutdown=5,
        )
        cloud = self.cloud

        class _Server(uvicorn.Server):
            async def shutdown(self, sockets: Any = None) -> None:
                # Answer open long-polls (try_again) now, not after the grace period.
                cloud.book.close()
                await super().shutdown(sockets=sockets)

        self._server = _Server(config)
        return self._server

    def start(self) -> str:
        if self._thread is not None:
            raise RuntimeError("TinkerService is already running")
        server = self._prepare()
        errors: list[BaseException] = []

        def run() -> None:
            try:
                server.run(sockets=[self._socket])
            except BaseException as exc:  # noqa: BLE001 - reported by start()
                errors.append(exc)

        self._thread = threading.Thread(target=run, name="tinker-uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not server.started:
            if errors or not self._thread.is_alive():
                self.stop()
                raise RuntimeError(f"TinkerCloud failed to start: {errors[0] if errors else 'server thread exited'}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("TinkerCloud did not start within 60 s")
            time.sleep(0.01)
        log.info("TinkerCloud serving %s at %s", self.settings.model, self.base_url)
        assert self.base_url is not None
        return self.base_url

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self._server = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        if self.cloud is not None:
            self.cloud.close()
            self.cloud = None

    def serve_forever(self) -> None:
        server = self._prepare()
        print(
            f"TinkerCloud serving {self.settings.model} at {self.base_url} "
            f"(data: {self.settings.data_dir}, db: {self.cloud.store.url})",
            file=sys.stderr,
            flush=True,
        )
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, _ignore_replayed_sigterm)
        try:
            server.run(sockets=[self._socket])
        except (KeyboardInterrupt, SystemExit):
            pass
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            self._server = None
            self.stop()

    def __enter__(self) -> TinkerService:  # noqa: PYI034 (Self needs Python 3.11)
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
