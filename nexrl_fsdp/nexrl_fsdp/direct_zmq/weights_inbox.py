"""`WeightsInbox`: where a worker group's ``push_weights`` lands in a process that is not a sampler process.

A local service samples in its own process, on engines it holds. To feed one from a
model's worker group, it opens an inbox (a ROUTER on 127.0.0.1 at a free port, served by
a thread), asks the group to ``push_weights`` to the inbox's endpoint, and gets the
weights handed to ``load`` the moment they arrive: rank 0 sends them as raw frames (the
same ``load_weights`` request a sampler process answers, `nexrl_fsdp.worker.weights_push`),
``load`` copies them out of the frames, and the inbox answers ``loaded`` (or the error),
which ends the group's op. Nothing is pickled and nothing touches the disk. The inbox
holds the group's key: a message not MACed with it is dropped (and logged) unread, so
only the group's rank 0 can hand ``load`` weights.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch
import zmq

from nexrl_fsdp.direct_zmq import wire

__all__ = ["WeightsInbox"]

logger = logging.getLogger(__name__)

_POLL_MS = 100


class WeightsInbox:
    """Receives one push of weights; use it as a context manager around the push."""

    def __init__(self, load: Callable[[dict[str, torch.Tensor]], Any], *, key: str) -> None:
        """``load`` gets every parameter by name (read-only views over the received
        frames: copy what must outlive the call) and may return a value, kept as `result`;
        ``key`` is the pushing group's key."""
        self._load = load
        self._key = key
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.RCVBUF, 1 << 23)
        self._socket.setsockopt(zmq.LINGER, 1000)
        port = self._socket.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.result: Any = None
        self.error: BaseException | None = None
        self._received = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="nexrl-weights-inbox", daemon=True)

    def __enter__(self) -> WeightsInbox:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close()
        self._context.term()

    def loaded(self) -> Any:
        """What ``load`` returned; raises what it raised, or RuntimeError when nothing came."""
        if self.error is not None:
            raise self.error
        if not self._received:
            raise RuntimeError(f"no weights arrived at {self.endpoint}")
        return self.result

    def _serve(self) -> None:
        while not self._stop.is_set() and not self._received:
            if not self._socket.poll(_POLL_MS):
                continue
            try:
                prefix, message = wire.recv(self._socket, key=self._key, prefix_frames=1)
            except wire.UnauthenticatedMessage as error:
                logger.warning("weights inbox %s: dropped a message: %s", self.endpoint, error)
                continue
            except wire.WireError:
                continue
            request_id = message.header.get("id")
            if message.header.get("kind") != "load_weights":
                wire.send(
                    self._socket,
                    {"kind": "error", "id": request_id, "error": "this inbox only takes load_weights"},
                    key=self._key,
                    prefix=prefix,
                )
                continue
            try:
                self.result = self._load(message.tensors)
                reply = {"kind": "loaded", "id": request_id}
            except Exception as error:  # noqa: BLE001 - answered to the pushing rank, raised by loaded()
                self.error = error
                reply = {"kind": "error", "id": request_id, "error": "".join(traceback.format_exception_only(type(error), error)).strip()}
            self._received = True
            wire.send(self._socket, reply, key=self._key, prefix=prefix)
