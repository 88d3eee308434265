"""An HTTP proxy on 127.0.0.1 that loses chosen answers, as a flaky network does.

`DroppingProxy` stands between a real SDK client and a real service. It forwards every
request to the service and, for the exchanges its ``drop`` rule picks, closes the
client's connection instead of passing the service's answer on: the service did the
work, the client only sees a connection that broke (``Server disconnected without
sending a response``). That is the failure after which a client must not simply send a
new request: the one it sent may have been applied already.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import attrs

__all__ = ["DroppingProxy", "Exchange"]

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection", "upgrade", "te", "trailer"}
_UPSTREAM_TIMEOUT_S = 600.0


@attrs.frozen
class Exchange:
    """One request the proxy forwarded and the service's answer to it."""

    method: str
    path: str
    """Without the query string."""
    request_body: bytes
    status: int
    response_body: bytes

    def request_json(self) -> Any:
        """The request's body as JSON; None when it is not JSON."""
        return _json(self.request_body)

    def response_json(self) -> Any:
        """The answer's body as JSON; None when it is not JSON."""
        return _json(self.response_body)


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


class DroppingProxy:
    """Forwards to ``upstream`` (a base URL); use it as a context manager.

    :param drop: called with each exchange once the service answered; True closes the
        client's connection instead of answering (the rule runs on the proxy's threads,
        one exchange at a time).
    """

    def __init__(self, upstream: str, drop: Callable[[Exchange], bool]) -> None:
        parts = urlsplit(upstream)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self._drop = drop
        self._lock = threading.Lock()
        self.exchanges: list[Exchange] = []
        """Every exchange, in the order the service answered them."""
        self.dropped: list[Exchange] = []
        """The exchanges whose answer the client never got."""
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                headers = {name: value for name, value in self.headers.items() if name.lower() not in _HOP_BY_HOP}
                upstream = http.client.HTTPConnection(*proxy._upstream, timeout=_UPSTREAM_TIMEOUT_S)
                try:
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    response = upstream.getresponse()
                    answer, answer_headers = response.read(), response.getheaders()
                finally:
                    upstream.close()
                exchange = Exchange(self.command, self.path.split("?")[0], body, response.status, answer)
                with proxy._lock:
                    proxy.exchanges.append(exchange)
                    lost = proxy._drop(exchange)
                    if lost:
                        proxy.dropped.append(exchange)
                if lost:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.send_response_only(response.status, response.reason)
                for name, value in answer_headers:
                    if name.lower() not in _HOP_BY_HOP:
                        self.send_header(name, value)
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _forward

            def log_message(self, format: str, *args: object) -> None:
                """Quiet: the test reads `DroppingProxy.exchanges`."""

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True, name="dropping-proxy"
        )

    def __enter__(self) -> DroppingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
