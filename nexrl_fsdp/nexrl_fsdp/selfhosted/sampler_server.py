"""The self-hosted run's sampler process: one `Engine` serving the driver's rollouts over ZMQ.

``python -m nexrl_fsdp.selfhosted.sampler_server --settings JSON --ready-file PATH --parent PID``

Why a process of its own: the rollouts' Python (templates, rewards, the trainer's
bookkeeping) and the sampler's torch calls then no longer share one GIL in the driver.
The process loads the engine, binds a ROUTER on 127.0.0.1 at a free port, writes its
endpoint to the ready file (atomically, so the driver reads it whole) and serves
messages in the direct-ZMQ wire format (`nexrl_fsdp.direct_zmq.wire`: a JSON header,
then raw tensor frames; nothing pickled). Each request header has a ``kind`` and an
``id`` the reply repeats:

* ``sample``: ``prompt`` (token ids), ``params`` (`SamplingParams` fields), ``seed``;
  answered ``sampled`` with ``tokens``, ``logprobs`` and ``stop_reason``.
* ``load_weights``: one raw frame per parameter, copied into the model in place;
  answered ``loaded`` once the copy is done, so sampling after the reply sees them.
  Rank 0 of the workers sends it (``push_weights``), or the driver forwards it.
* ``export``: ``path``; the weights, tokenizer and chat template as an HF directory.
* ``info``: the process id, its torch threads and the batching settings it runs with.
* ``close``: answered ``closing``; the process then exits.

Any failure is answered ``error`` with the exception's type and message. Every torch
call runs on one `ComputeThread` (first in, first out, concurrent samples batched), so
samples queued before a weight load use the old weights and those after it the new;
this thread only receives and sends, and answers a request as soon as its future is
done. A watcher thread ends the process when the driver (``--parent``) is gone, so a
killed run leaves no sampler behind.

The process holds the worker group's key, from ``NEXRL_WORKER_KEY`` (the driver sets it in
its environment, never on its command line, which every user of the machine can read):
every request and reply carries the key's MAC, and a request without it (someone else
who reaches the port) is dropped and logged unread, so it can neither sample nor
replace the weights.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

import nexrl_engine  # noqa: F401 - sets the OpenMP wait policy before torch loads

# isort: split
import torch
import zmq

from nexrl_engine.batching import BatchedSamplingOptions
from nexrl_engine.chat import EngineChat
from nexrl_engine.config import EngineConfig
from nexrl_engine.engine import Engine
from nexrl_engine.lora import load_in_place
from nexrl_engine.types import SampledSequence, SamplingParams
from nexrl_fsdp.direct_zmq import wire
from nexrl_fsdp.direct_zmq.group_key import MissingGroupKey, key_from_env
from nexrl_fsdp.process_exit import exit_at_once

__all__ = ["SamplerSettings", "SamplerServer", "main"]

_PARENT_POLL_S = 0.5


@attrs.frozen(kw_only=True)
class SamplerSettings:
    """What the sampler process loads and how it batches (passed as JSON on its command line)."""

    engine: EngineConfig
    batching: BatchedSamplingOptions

    def to_json(self) -> str:
        return json.dumps(
            {
                "engine": {"model": self.engine.model, "dtype": self.engine.dtype, "seed": self.engine.seed, "device": self.engine.device},
                "batching": attrs.asdict(self.batching),
            }
        )

    @classmethod
    def from_json(cls, text: str) -> SamplerSettings:
        values = json.loads(text)
        return cls(engine=EngineConfig(**values["engine"]), batching=BatchedSamplingOptions(**values["batching"]))


class SamplerServer:
    """Serves one engine on a ROUTER socket until a ``close`` request."""

    def __init__(self, engine: Engine, batching: BatchedSamplingOptions, *, key: str) -> None:
        self.key = key
        self.engine = engine
        self.batching = batching
        self.chat = EngineChat(engine, batching, name="nexrl-sampler-compute")
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.RCVBUF, 1 << 23)
        self.socket.setsockopt(zmq.SNDBUF, 1 << 23)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._done: collections.deque[tuple[bytes, dict[str, Any]]] = collections.deque()
        """Replies finished on the compute thread, waiting to be sent from the serving thread."""
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)

    def serve(self) -> None:
        """Answer requests until one says ``close``."""
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        closing = False
        while not closing:
            ready = dict(poller.poll())
            if self._wake_read in ready:
                os.read(self._wake_read, 1 << 16)
            while self._done:
                identity, header = self._done.popleft()
                wire.send(self.socket, header, key=self.key, prefix=[identity])
            if self.socket in ready:
                while self.socket.poll(0):
                    closing = self._receive() or closing
        self.close()

    def _receive(self) -> bool:
        """Handle one request; True when it asks the process to exit."""
        try:
            prefix, message = wire.recv(self.socket, key=self.key, prefix_frames=1)
        except wire.UnauthenticatedMessage as error:
            print(f"sampler: dropped a message: {error}", flush=True)
            return False
        except wire.WireError as error:
            print(f"sampler: ignored a malformed message: {error}", flush=True)
            return False
        identity, header = prefix[0], message.header
        kind, request_id = header.get("kind"), header.get("id")
        try:
            if kind == "sample":
                params = SamplingParams(**header["params"])
                sampled = self.chat.compute.submit_sample(header["prompt"], params, header.get("seed"))
                self._answer_when_done(identity, request_id, sampled, _sampled)
            elif kind == "load_weights":
                tensors = message.tensors
                loaded = self.chat.compute.submit(lambda: load_in_place(self.engine.model, tensors))
                self._answer_when_done(identity, request_id, loaded, lambda _: {"kind": "loaded"})
            elif kind == "export":
                path = Path(header["path"])
                exported = self.chat.compute.submit(lambda: self.engine.export_hf(path))
                self._answer_when_done(identity, request_id, exported, lambda done: {"kind": "exported", "path": str(done)})
            elif kind == "info":
                wire.send(
                    self.socket,
                    {
                        "kind": "info",
                        "id": request_id,
                        "pid": os.getpid(),
                        "endpoint": self.endpoint,
                        "threads": torch.get_num_threads(),
                        **attrs.asdict(self.batching),
                    },
                    key=self.key,
                    prefix=[identity],
                )
            elif kind == "close":
                wire.send(self.socket, {"kind": "closing", "id": request_id}, key=self.key, prefix=[identity])
                return True
            else:
                raise ValueError(f"unknown request kind {kind!r}; the sampler answers sample, load_weights, export, info and close")
        except Exception as error:  # noqa: BLE001 - a bad request is answered, the server keeps serving
            wire.send(self.socket, _error(request_id, error), key=self.key, prefix=[identity])
        return False

    def _answer_when_done(
        self, identity: bytes, request_id: Any, future: concurrent.futures.Future[Any], reply: Callable[[Any], dict[str, Any]]
    ) -> None:
        def done(finished: concurrent.futures.Future[Any]) -> None:
            error = finished.exception()
            header = _error(request_id, error) if error is not None else {**reply(finished.result()), "id": request_id}
            self._done.append((identity, header))
            try:
                os.write(self._wake_write, b"\0")
            except BlockingIOError:
                pass  # the pipe is full of wake-ups already; the serving thread will drain it

        future.add_done_callback(done)

    def close(self) -> None:
        self.chat.close()
        self.socket.close(linger=2000)  # let the ``closing`` reply leave
        self.context.term()
        os.close(self._wake_read)
        os.close(self._wake_write)


def _sampled(sequence: SampledSequence) -> dict[str, Any]:
    return {"kind": "sampled", "tokens": sequence.tokens, "logprobs": sequence.logprobs, "stop_reason": sequence.stop_reason}


def _error(request_id: Any, error: BaseException) -> dict[str, Any]:
    text = str(error) if isinstance(error, ValueError) else "".join(traceback.format_exception(type(error), error, error.__traceback__))
    return {"kind": "error", "id": request_id, "error_type": type(error).__name__, "error": text}


def _watch_parent(parent: int) -> None:
    """Exit at once when the driver that started this process is gone (nothing here needs saving)."""
    while os.getppid() == parent:
        time.sleep(_PARENT_POLL_S)
    print(f"sampler: the driver (process {parent}) is gone; exiting", flush=True)
    os._exit(1)


def _write_ready(path: Path, endpoint: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({"endpoint": endpoint, "pid": os.getpid()}))
    partial.replace(path)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m nexrl_fsdp.selfhosted.sampler_server")
    parser.add_argument("--settings", required=True, help="SamplerSettings as JSON")
    parser.add_argument("--ready-file", required=True, type=Path, help="where to write the endpoint once serving")
    parser.add_argument("--parent", required=True, type=int, help="the driver's pid; the process exits when it is gone")
    args = parser.parse_args()
    try:
        key = key_from_env("the sampler process")
    except MissingGroupKey as error:
        sys.exit(f"sampler: {error}")
    threading.Thread(target=_watch_parent, args=(args.parent,), name="parent-watch", daemon=True).start()
    settings = SamplerSettings.from_json(args.settings)
    server = SamplerServer(Engine(settings.engine), settings.batching, key=key)
    _write_ready(args.ready_file, server.endpoint)
    print(f"sampler: serving {settings.engine.model} ({settings.engine.dtype}, {settings.engine.device}) at {server.endpoint}", flush=True)
    server.serve()
    exit_at_once()


if __name__ == "__main__":
    main()
