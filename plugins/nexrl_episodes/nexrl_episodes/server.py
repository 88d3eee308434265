"""`EpisodeServer`: the episode routes on uvicorn in a background thread, plus the stale-claim janitor.

The listening socket is bound before uvicorn starts (`nexrl_core.http.serving.listen`), so
port 0 yields a real port to report and a busy port fails in `start` with a clear
error. The server runs in the
training process because its OpenAI endpoints call the backend's `ChatModel`, which
may live in this process (the ``inprocess`` backend).
"""

from __future__ import annotations

import concurrent.futures
import logging
import socket
import threading
from typing import Any

from nexrl_core.chat.model import ChatModel
from nexrl_core.http.serving import UvicornServer, base_url_of, listen
from nexrl_episodes.app import create_app
from nexrl_episodes.book import EpisodeBook
from nexrl_episodes.openai_api import OpenAIEndpoints

log = logging.getLogger("nexrl.episodes")

SAMPLING_THREADS = 256
"""Model calls in flight at once: enough for a whole step's runs, so a backend can batch them."""


class EpisodeServer:
    """Serves ``book`` (and ``model`` through the OpenAI routes) on ``host:port`` until `stop`."""

    def __init__(
        self,
        book: EpisodeBook,
        model: ChatModel | None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        public_url: str | None = None,
        api_key: str | None = None,
        train_config: dict[str, Any] | None = None,
    ) -> None:
        self.book = book
        self.host = host
        self.port = port
        self.public_url = public_url
        self.base_url = ""
        self._executor = concurrent.futures.ThreadPoolExecutor(SAMPLING_THREADS, thread_name_prefix="nexrl-episode-call")
        endpoints = OpenAIEndpoints(book, model, self._executor) if model is not None else None
        self.app = create_app(
            book,
            endpoints=endpoints,
            base_url=lambda: self.public_url or self.base_url,
            api_key=api_key,
            train_config=train_config or {},
        )
        self._server: UvicornServer | None = None
        self._janitor: threading.Thread | None = None
        self._stopping = threading.Event()
        self._socket: socket.socket | None = None

    def start(self) -> str:
        """Serve in the background; returns the base URL."""
        try:
            self._socket = listen(self.host, self.port)
        except OSError as error:
            raise RuntimeError(
                f"the episode server cannot listen on {self.host}:{self.port}: {error}; "
                "choose another rollout.source.options.port (0 picks a free one)"
            ) from None
        self.base_url = base_url_of(self._socket)
        self._server = UvicornServer(
            self.app, self._socket, name="nexrl-episode-server", timeout_keep_alive=75, timeout_graceful_shutdown=2
        )
        try:
            self._server.start("the episode server", timeout_s=30)
        except RuntimeError:
            self.stop()
            raise
        self._janitor = threading.Thread(target=self._sweep, name="nexrl-episode-janitor", daemon=True)
        self._janitor.start()
        log.info("episode server at %s", self.base_url)
        return self.base_url

    def _sweep(self) -> None:
        interval = min(1.0, self.book.claim_timeout_s / 4)
        while not self._stopping.wait(interval):
            requeued = self.book.requeue_stale()
            if requeued:
                log.info("%d stale claim(s) went back to the queue", requeued)

    def stop(self) -> None:
        """Stop serving; every thread it started has ended when this returns."""
        self._stopping.set()
        if self._server is not None:
            self._server.stop(timeout_s=30)
        if self._janitor is not None:
            self._janitor.join(timeout=5)
            self._janitor = None
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        self._server = None
