"""What answers on a service's address after its child process died.

A service started with ``separate_process`` serves from a child process on a socket the
parent bound. When the child dies, the SDKs' clients (tinker, nex-weaver) take the refused
or reset connections for a passing network fault and retry for minutes. The parent's
copy of the listening socket lets it answer instead: every request gets ``410 Gone``
with ``x-should-retry: false`` and the reason, so each client call fails at once and says
why. Nothing is served: the models' state stays in the dead service's store and files
for the next start.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["Tombstone"]


class Tombstone:
    """Answers every request on ``sock`` with 410 and ``reason`` until `close`."""

    def __init__(self, sock: socket.socket, reason: str, accepted: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        """:param accepted: route -> answer, for routes clients post to in the background
        and only log about when refused (the tinker SDK's telemetry); they get ``200``
        and their answer, so what a client reports is the refusal of a call it waits on."""
        answers = {path: json.dumps(answer).encode() for path, answer in (accepted or {}).items()}
        gone = json.dumps({"detail": reason, "message": reason}).encode()

        class Gone(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                if length:
                    self.rfile.read(length)
                body = answers.get(self.path.split("?")[0])
                self.send_response(410 if body is None else 200)
                body = gone if body is None else body
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.send_header("x-should-retry", "false")
                self.send_header("connection", "close")
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _answer

            def log_message(self, format: str, *args: object) -> None:
                """Quiet: the service's owner reports the death once."""

        sock.setblocking(True)
        self._server = ThreadingHTTPServer(sock.getsockname()[:2], Gone, bind_and_activate=False)
        self._server.socket = sock
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True, name="service-tombstone"
        )
        self._thread.start()

    def close(self) -> None:
        """Stop answering (the socket stays open: its owner closes it)."""
        self._server.shutdown()
        self._thread.join(timeout=10)
