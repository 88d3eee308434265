"""How fast does a batch reach rank 0 over the direct-ZMQ wire?

A driver sends a batch of 1, 10 and 100 MB (float32 tensors) to a receiver process that
stands where a worker's rank 0 does: a ROUTER socket on 127.0.0.1 that decodes the
message into tensors and acknowledges it. Timed per send, from the first byte handed to
ZMQ to the ACK, for three ways of moving the same bytes:

* ``wire``: `nexrl_fsdp.direct_zmq.wire` (JSON header, raw frames sent zero-copy, tensors
  built over the received buffers, the MAC under the group's key made on one side
  and checked on the other, as every message of a worker group is);
* ``pickle``: the same tensors pickled, sent over the same sockets, unpickled there (what
  the original NexRL did; the product never unpickles a socket, this is the baseline);
* ``copy``: no socket at all, a copy of the same bytes into freshly allocated memory in
  one process (what moving the data cannot beat by much: the receiver's bytes are fresh
  memory too).

Target: wire throughput >= 75 % of copy throughput at 100 MB. Prints medians over
``--reps`` sends (after one warm-up) and a PASS/FAIL verdict; exits 0 either way.

Run: ``.venv/bin/python benchmarks/zmq_transport.py [--reps N] [--sizes-mb 1 10 100]``.
"""

from __future__ import annotations

import argparse
import io
import mmap
import os
import pickle
import statistics
import subprocess
import sys
import time

import torch
import zmq

from nexrl_fsdp.direct_zmq import wire
from nexrl_fsdp.direct_zmq.group_key import ENV_WORKER_KEY, key_from_env, new_group_key

TARGET_RATIO = 0.75
MB = 1 << 20
KEY = new_group_key()
"""The benchmark's group key, given to the receiver through the environment as a group's is."""


def _batch(size_mb: int) -> dict[str, torch.Tensor]:
    """A batch of about ``size_mb`` MB: four [B, L] float32 tensors, as a Batch would carry."""
    elements = size_mb * MB // 4 // 4
    generator = torch.Generator().manual_seed(size_mb)
    return {name: torch.randn(elements, generator=generator) for name in ("input_ids", "loss_mask", "old_logprobs", "advantages")}


def receive_forever(port: int, key: str) -> None:
    """The rank-0 stand-in: decode each message (wire or pickle) and ACK it."""
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.RCVBUF, 1 << 23)
    socket.bind(f"tcp://127.0.0.1:{port}")
    while True:
        frames = socket.recv_multipart(copy=False)
        identity, body = bytes(frames[0].buffer), frames[1:]
        if bytes(body[0].buffer) == b"pickle":
            tensors = pickle.loads(body[1].buffer)  # noqa: S301 - the benchmark's own baseline, on its own loopback socket
            count = len(tensors)
        else:
            message = wire.decode(body, key=key)
            if message.header.get("kind") == "stop":
                socket.send_multipart([identity, b"bye"])
                break
            count = len(message.tensors)
        socket.send_multipart([identity, str(count).encode()])
    socket.close(linger=0)
    context.term()


def _time_sends(send: callable, socket: zmq.Socket, reps: int) -> float:
    times = []
    for rep in range(reps + 1):
        start = time.perf_counter()
        send()
        socket.recv()
        if rep:  # the first send warms the sockets and allocator
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _pickled(tensors: dict[str, torch.Tensor]) -> bytes:
    buffer = io.BytesIO()
    pickle.dump(tensors, buffer, protocol=pickle.HIGHEST_PROTOCOL)
    return buffer.getvalue()


def _time_copy(tensors: dict[str, torch.Tensor], reps: int) -> float:
    times = []
    for rep in range(reps + 1):
        start = time.perf_counter()
        for tensor in tensors.values():
            # Anonymous mmap: pages the kernel has never handed out, as a received message gets
            # (a reused allocator block would flatter the copy).
            fresh = mmap.mmap(-1, tensor.numel() * tensor.element_size())
            torch.frombuffer(fresh, dtype=tensor.dtype).copy_(tensor.reshape(-1))
        if rep:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 10, 100])
    parser.add_argument("--receiver", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receiver is not None:
        receive_forever(args.receiver, key_from_env("the benchmark's receiver"))
        return
    torch.set_num_threads(1)
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.SNDBUF, 1 << 23)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    socket.unbind(socket.last_endpoint)
    receiver = subprocess.Popen([sys.executable, __file__, "--receiver", str(port)], env={**os.environ, ENV_WORKER_KEY: KEY})
    socket.connect(f"tcp://127.0.0.1:{port}")
    verdict_ratio = None
    try:
        print(f"{'size':>7} {'wire GB/s':>10} {'pickle GB/s':>12} {'copy GB/s':>10} {'wire/copy':>10} {'wire/pickle':>12}")
        for size_mb in args.sizes_mb:
            tensors = _batch(size_mb)
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            wire_s = _time_sends(lambda: wire.send(socket, {"kind": "data", "op_id": "bench"}, tensors, key=KEY), socket, args.reps)  # noqa: B023 - called in this iteration
            pickle_s = _time_sends(lambda: socket.send_multipart([b"pickle", _pickled(tensors)]), socket, args.reps)  # noqa: B023 - called in this iteration
            copy_s = _time_copy(tensors, args.reps)
            rates = [nbytes / seconds / 1e9 for seconds in (wire_s, pickle_s, copy_s)]
            print(
                f"{size_mb:>5}MB {rates[0]:>10.2f} {rates[1]:>12.2f} {rates[2]:>10.2f} "
                f"{rates[0] / rates[2]:>10.2f} {rates[0] / rates[1]:>12.2f}"
            )
            if size_mb == max(args.sizes_mb):
                verdict_ratio = rates[0] / rates[2]
        wire.send(socket, {"kind": "stop"}, key=KEY)
        socket.recv()
    finally:
        receiver.wait(timeout=30) if receiver.poll() is None else None
        if receiver.poll() is None:
            receiver.kill()
        socket.close(linger=0)
        context.term()
    if verdict_ratio is not None:
        status = "PASS" if verdict_ratio >= TARGET_RATIO else "FAIL"
        print(f"{status}: wire/copy at {max(args.sizes_mb)} MB is {verdict_ratio:.2f} (target >= {TARGET_RATIO})")


if __name__ == "__main__":
    main()
