"""`SamplerProcess`: the driver's handle on the sampler process (`sampler_server`).

It starts ``python -m nexrl_fsdp.selfhosted.sampler_server`` in its own session (so a
Ctrl-C reaches the driver, whose `stop` then ends it in order) with the driver's
environment (plus ``extra_env``), its output in a log file, and waits for the endpoint it reports. Requests
travel in the direct-ZMQ wire format (JSON header, raw tensor frames). Each calling
thread gets its own DEALER socket, so the rollouts' many threads sample concurrently
without a lock, and the server batches what they send. While a thread waits for its
answer it checks that the process lives: if it died, the call raises `SamplerError`
naming it, with the end of its log, within a second instead of hanging. The process
gets the worker group's key in its environment (``NEXRL_WORKER_KEY``; a command line is
readable by every user of the machine), and every message both ways carries its MAC.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import torch
import zmq

from nexrl_fsdp.direct_zmq import wire
from nexrl_fsdp.direct_zmq.group_key import ENV_WORKER_KEY
from nexrl_fsdp.selfhosted.sampler_server import SamplerSettings

__all__ = ["SamplerError", "SamplerProcess"]

_POLL_S = 0.2
_START_TIMEOUT_S = 300.0
_STOP_TIMEOUT_S = 10.0
_SEND_TIMEOUT_MS = 10_000


class SamplerError(RuntimeError):
    """The sampler process failed to start, died, or failed a request."""


class SamplerProcess:
    """A running sampler process and the sockets this process talks to it on."""

    def __init__(self, settings: SamplerSettings, log_path: Path, *, key: str, extra_env: Mapping[str, str] | None = None) -> None:
        """``key`` is the run's key: the worker group's, whose rank 0 pushes weights to the
        process (with a ``workers_url`` group, whose weights come through the driver, the
        same key still guards the process's port)."""
        self.settings = settings
        self.key = key
        self._extra_env = dict(extra_env or {})
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._ready_file = self.log_path.with_name(self.log_path.stem + ".ready.json")
        self._ready_file.unlink(missing_ok=True)
        self._log: IO[bytes] | None = open(self.log_path, "ab")  # noqa: SIM115 - closed by stop()
        self._log_start = self._log.tell()
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "nexrl_fsdp.selfhosted.sampler_server",
                "--settings",
                settings.to_json(),
                "--ready-file",
                str(self._ready_file),
                "--parent",
                str(os.getpid()),
            ],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self._extra_env, ENV_WORKER_KEY: key},
            start_new_session=True,
        )
        self.endpoint: str | None = None
        self._context = zmq.Context()
        self._local = threading.local()
        self._ids = itertools.count()
        self._closed = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def death(self) -> str | None:
        """How the process died, in one line naming its log; None while it runs or once it was stopped."""
        code = None if self._closed else self.process.poll()
        if code is None:
            return None
        return f"the sampler process (pid {self.pid}) is dead (exit status {code}; its output: {self.log_path})"

    def respawn(self) -> SamplerProcess:
        """A new process like this one (settings, log, environment), after this one died;
        it has the base weights until it is given others."""
        self.stop()
        return SamplerProcess(self.settings, self.log_path, key=self.key, extra_env=self._extra_env)

    def wait_ready(self, timeout_s: float = _START_TIMEOUT_S) -> None:
        """Wait until the process serves (it has loaded the model).

        :raises SamplerError: when it exits first (with its output) or takes longer than ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while not self._ready_file.exists():
            code = self.process.poll()
            if code is not None:
                raise SamplerError(
                    f"the sampler process failed to start: it exited with status {code} while loading "
                    f"{self.settings.engine.model!r}; last output ({self.log_path}):\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise SamplerError(
                    f"the sampler process did not start within {timeout_s:.0f} s; last output ({self.log_path}):\n{self.log_tail()}"
                )
            time.sleep(0.05)
        self.endpoint = str(json.loads(self._ready_file.read_text())["endpoint"])

    def request(self, header: Mapping[str, Any], tensors: Mapping[str, torch.Tensor] | None = None) -> wire.Message:
        """Send one request from this thread and wait for its answer.

        :raises SamplerError: when the process is gone (or dies while answering) or
            fails the request; ``ValueError`` when it refused the request's values.
        """
        socket = self._socket()
        request_id = next(self._ids)
        kind = header["kind"]
        self.check_alive(kind)
        try:
            wire.send(socket, {**header, "id": request_id}, tensors, key=self.key)
        except zmq.Again:
            self.check_alive(kind)
            raise SamplerError(
                f"the sampler process (pid {self.pid}) did not take a {kind} request for {_SEND_TIMEOUT_MS / 1000:.0f} s"
            ) from None
        while True:
            if socket.poll(int(_POLL_S * 1000)):
                try:
                    _, reply = wire.recv(socket, key=self.key)
                except wire.UnauthenticatedMessage as error:
                    raise SamplerError(f"the sampler process (pid {self.pid}) answered a {kind} request without the key: {error}") from None
                if reply.header.get("id") != request_id:
                    continue  # the answer to a request whose caller gave up on it
                if reply.header.get("kind") == "error":
                    if reply.header.get("error_type") == "ValueError":
                        raise ValueError(reply.header["error"])
                    raise SamplerError(f"the sampler process failed a {kind} request: {reply.header['error']}")
                return reply
            self.check_alive(kind)

    def stop(self) -> None:
        """Ask the process to exit, kill it if it has not after a timeout, and release
        every thread's socket (call it once the rollouts are done)."""
        if self._closed:
            return
        self._closed = True
        if self.alive() and self.endpoint is not None:
            try:
                socket = self._context.socket(zmq.DEALER)
                socket.setsockopt(zmq.LINGER, 0)
                socket.connect(self.endpoint)
                wire.send(socket, {"kind": "close", "id": -1}, key=self.key)
                socket.poll(int(_STOP_TIMEOUT_S * 1000))
                socket.close()
            except zmq.ZMQError:
                pass
        elif self.alive():
            self.process.terminate()  # still loading the model: nothing to finish
        try:
            self.process.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._context.destroy(linger=0)
        if self._log is not None:
            self._log.close()
            self._log = None
        self._ready_file.unlink(missing_ok=True)

    def log_tail(self, limit: int = 4000) -> str:
        """The end of what the process has written since it was started."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_start)
                return log.read().decode("utf-8", "replace")[-limit:].strip()
        except OSError:
            return ""

    def _socket(self) -> Any:
        socket = getattr(self._local, "socket", None)
        if socket is None:
            if self._closed:
                raise SamplerError("the sampler process was stopped (the backend is closed)")
            if self.endpoint is None:
                raise SamplerError("the sampler process is not serving yet; call wait_ready first")
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
            socket.setsockopt(zmq.SNDBUF, 1 << 23)
            socket.setsockopt(zmq.RCVBUF, 1 << 23)
            socket.connect(self.endpoint)
            self._local.socket = socket
        return socket

    def check_alive(self, kind: str) -> None:
        """:raises SamplerError: naming the process and the end of its log, when it is gone."""
        if self._closed:
            raise SamplerError("the sampler process was stopped (the backend is closed)")
        death = self.death()
        if death is not None:
            raise SamplerError(f"during a {kind} request, {death}; its last output:\n{self.log_tail()}")
