"""How NexRL's HTTP apps start (`nexrl_core.http.serving`): the socket first, then uvicorn."""

from __future__ import annotations

import json
import socket
import urllib.request
from typing import Any

import pytest

from nexrl_core.http.serving import UvicornServer, base_url_of, listen


async def hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The smallest ASGI app: every GET answers ``{"hello": path}``."""
    body = json.dumps({"hello": scope["path"]}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


def test_port_0_listens_on_a_real_port_and_a_taken_one_fails_at_once() -> None:
    sock = listen("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        assert port > 0 and base_url_of(sock) == f"http://127.0.0.1:{port}"
        with pytest.raises(OSError):
            listen("127.0.0.1", port)
    finally:
        sock.close()


def test_an_ipv6_url_has_its_host_in_brackets() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    try:
        sock = listen("::1", 0)
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    try:
        assert base_url_of(sock) == f"http://[::1]:{sock.getsockname()[1]}"
    finally:
        sock.close()


def test_a_started_server_answers_until_stopped_and_runs_its_shutdown_hook() -> None:
    sock = listen("127.0.0.1", 0)
    shut_down: list[bool] = []
    server = UvicornServer(hello, sock, name="test-uvicorn", on_shutdown=lambda: shut_down.append(True))
    try:
        server.start("the test server", timeout_s=30)
        with urllib.request.urlopen(f"{base_url_of(sock)}/ping", timeout=10) as response:
            assert json.loads(response.read()) == {"hello": "/ping"}
        assert not server.thread_died()
    finally:
        server.stop()
        sock.close()
    assert shut_down == [True]
    assert not server.thread_died(), "a server stop ended has no thread that died"


def test_a_server_that_cannot_serve_says_so() -> None:
    sock = listen("127.0.0.1", 0)
    sock.close()  # uvicorn cannot accept on a closed socket
    server = UvicornServer(hello, sock, name="test-uvicorn")
    with pytest.raises(RuntimeError, match="the test server failed to start: "):
        server.start("the test server", timeout_s=30)
