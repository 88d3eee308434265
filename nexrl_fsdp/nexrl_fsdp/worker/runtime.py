"""A worker rank's life: register, beat, wait for "execute", run the op with the other ranks.

Rank 0 owns the data socket the driver talks to (a ROUTER): a driver sends an op's
header and tensors there, rank 0 checks them and answers ACK (or the reason it refuses
them, so a malformed batch never reaches the other ranks). The driver then asks the API
server to broadcast "execute"; every rank gets it on its command subscription, rank 0
broadcasts the op's header over torch.distributed and scatters the batch by rows, every
rank runs the op, and rank 0 sends the result back on the data socket (``push_weights``
first sends the gathered policy straight to a sampler process, `weights_push`). Nothing
is pickled: headers are JSON (as uint8 tensors between ranks), tensors are raw frames.

A watchdog process (`watchdog`) beats for the rank and ends it when the API server is
gone or calls the group dead, so no worker outlives its run. A rank whose watchdog is gone
(nothing beats for it, nothing would end it) reports so and leaves between ops, within a
second: its group is lost at once and replaced whole, not a heartbeat deadline later.

A rank holds the group's key (``NEXRL_WORKER_KEY``, `nexrl_fsdp.direct_zmq.group_key`):
it sends it as a bearer token on every call to the API server, acts only on commands
whose MAC it checks, and rank 0 drops (and logs) every data message not MACed with it,
so nothing someone without the key sends to its port is acknowledged, stored or run.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import traceback
import urllib.request
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import zmq

from nexrl_fsdp.direct_zmq import wire
from nexrl_fsdp.direct_zmq.group_key import bearer_header, key_from_env
from nexrl_fsdp.direct_zmq.protocol import (
    BATCH_OPS,
    DATUM_OPS,
    ENV_COLLECTIVE_TIMEOUT,
    ENV_DATA_BASE_PORT,
    ENV_HEARTBEAT_INTERVAL,
    ENV_WORKER_IP,
    OPS,
)
from nexrl_fsdp.worker.actor import ActorOptions, FsdpActor, ModelOptions
from nexrl_fsdp.worker.datum_ops import ENGINE_OPS, DatumOps
from nexrl_fsdp.worker.devices import process_group_backend, rank_device
from nexrl_fsdp.worker.loopback import process_group_store
from nexrl_fsdp.worker.rows import BatchError, check_batch
from nexrl_fsdp.worker.weights_push import push_weights

__all__ = ["WatchdogGone", "WorkerRank"]

logger = logging.getLogger("nexrl_fsdp.worker")

_MODEL_OPS = frozenset({"get_weights", "push_weights", "save_checkpoint", "load_checkpoint", "export_hf"})
"""Ops of the self-hosted backend without a batch that need the model loaded."""
_ERROR_BYTES = 8192
"""Most bytes of a rank's traceback that travel to rank 0."""


class WatchdogGone(RuntimeError):
    """The rank's watchdog exited: the rank leaves, and its group is replaced."""


def _http(url: str, key: str, body: dict[str, Any] | None = None, timeout: float = 10.0) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"content-type": "application/json", **bearer_header(key)}
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST", headers=headers)
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


class WorkerRank:
    """One rank of a worker group (under torchrun or the loopback launcher)."""

    def __init__(self, api_server_url: str, identifier: str) -> None:
        """:raises MissingGroupKey: when ``NEXRL_WORKER_KEY`` is unset (before anything starts)."""
        self.key = key_from_env(f"worker rank {os.environ.get('RANK', '0')} of group {identifier!r}")
        self.api = api_server_url.rstrip("/") + "/api/v1"
        self.identifier = identifier
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.heartbeat_s = float(os.environ.get(ENV_HEARTBEAT_INTERVAL, "5"))
        self.context = zmq.Context()
        self.actor: FsdpActor | None = None
        self.datum_ops: DatumOps | None = None
        self.pending: dict[str, tuple[bytes, wire.Message]] = {}
        self.watchdog: subprocess.Popen[bytes] | None = None

    # --- start -----------------------------------------------------------------------------

    def start(self) -> None:
        """Join the process group (`devices`: the rank's own GPU and ``cpu:gloo,cuda:nccl``
        under CUDA, gloo on CPUs), report the data endpoint and start the watchdog."""
        self.device = rank_device(int(os.environ.get("LOCAL_RANK", "0")))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        timeout = timedelta(seconds=float(os.environ.get(ENV_COLLECTIVE_TIMEOUT, "600")))
        backend = process_group_backend(self.device.type)
        store = process_group_store(self.rank, self.world_size, timeout)
        if store is None:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout, store=store, rank=self.rank, world_size=self.world_size)
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(self.device.type, (self.world_size,))
        group = _http(f"{self.api}/groups", self.key, {"identifier": self.identifier, "world_size": self.world_size})
        self.commands = self.context.socket(zmq.SUB)
        self.commands.setsockopt(zmq.SUBSCRIBE, self.identifier.encode())
        self.commands.connect(group["command_endpoint"])
        while self._command() is None:  # the server's periodic hello: the subscription is live
            pass
        self.data = self.context.socket(zmq.ROUTER)
        self.data.setsockopt(zmq.RCVBUF, 1 << 23)
        self.data.setsockopt(zmq.SNDBUF, 1 << 23)
        host = os.environ.get(ENV_WORKER_IP, "127.0.0.1")
        base = int(os.environ.get(ENV_DATA_BASE_PORT, "0") or 0)
        if base:
            self.data.bind(f"tcp://{host}:{base + self.rank}")
            port = base + self.rank
        else:
            port = self.data.bind_to_random_port(f"tcp://{host}")
        _http(
            f"{self.api}/groups/{self.identifier}/workers",
            self.key,
            {"rank": self.rank, "endpoint": f"tcp://{host}:{port}", "pid": os.getpid(), "host": socket.gethostname()},
        )
        self.watchdog = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "nexrl_fsdp.worker.watchdog",
                "--pid",
                str(os.getpid()),
                "--parent",
                str(os.getppid()),
                "--rank",
                str(self.rank),
                "--group-url",
                f"{self.api}/groups/{self.identifier}",
                "--interval",
                str(self.heartbeat_s),
            ],
            stdin=subprocess.DEVNULL,
        )

    # --- the loop -----------------------------------------------------------------------------

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.commands, zmq.POLLIN)
        if self.rank == 0:
            poller.register(self.data, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(1000))
            self._check_watchdog()
            if self.rank == 0 and self.data in ready:
                self._receive_data()
            if self.commands in ready:
                command = self._command()
                if command is None or command.get("kind") != "execute":
                    continue
                if self._execute(command) == "destroy":
                    return

    def _check_watchdog(self) -> None:
        """Raise `WatchdogGone` once the watchdog has exited (the caller reports it to the API
        server, which calls the group dead at once)."""
        watchdog = self.watchdog
        if watchdog is not None and (status := watchdog.poll()) is not None:
            raise WatchdogGone(f"its watchdog (pid {watchdog.pid}) exited with status {status}, so nothing beats for it")

    def _command(self) -> dict[str, Any] | None:
        """The next command from the API server; None (logged) for one whose MAC is not the
        group key's: whoever can reach the command socket's port cannot make ranks run."""
        frames = self.commands.recv_multipart()
        try:
            _, body = wire.verify_mac(frames, self.key)
        except wire.UnauthenticatedMessage as error:
            logger.warning("rank %d: dropped a command: %s", self.rank, error)
            return None
        return json.loads(body)

    def _receive_data(self) -> None:
        """Store an op's data by op id and ACK it, or answer why it is refused; a message
        not MACed with the group's key is dropped unanswered (its sender lacks the key,
        so it learns nothing, not even that the op was refused)."""
        try:
            prefix, message = wire.recv(self.data, key=self.key, prefix_frames=1)
        except wire.UnauthenticatedMessage as error:
            logger.warning("rank 0: dropped a data message: %s", error)
            return
        except wire.WireError as error:
            logger.warning("rank 0: refused a malformed message: %s", error)
            return
        identity, header = prefix[0], message.header
        op_id = str(header.get("op_id", ""))
        try:
            self._check(header, message.tensors)
        except (BatchError, ValueError, TypeError) as error:
            wire.send(
                self.data,
                {"kind": "refused", "op_id": op_id, "error": f"{header.get('op')} refused: {error}"},
                key=self.key,
                prefix=[identity],
            )
            return
        self.pending[op_id] = (identity, message)
        wire.send(self.data, {"kind": "ack", "op_id": op_id}, key=self.key, prefix=[identity])

    def _check(self, header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        op = header.get("op")
        if op not in OPS:
            raise BatchError(f"unknown op {op!r}; the workers run {', '.join(OPS)}")
        if not header.get("op_id"):
            raise BatchError("the message has no op_id")
        if op in BATCH_OPS or op in ENGINE_OPS or op in _MODEL_OPS:
            if self.actor is None or self.datum_ops is None:
                raise BatchError("the model is not initialised; call init_model first")
        if op == "push_weights":
            options = header.get("options", {})
            endpoint, timeout_s = options.get("endpoint"), options.get("timeout_s")
            if not isinstance(endpoint, str) or not endpoint.startswith(("tcp://", "ipc://")):
                raise BatchError(f"push_weights needs options.endpoint, the sampler's tcp:// or ipc:// address; got {endpoint!r}")
            if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
                raise BatchError(f"push_weights needs options.timeout_s, a positive number of seconds; got {timeout_s!r}")
        if op in BATCH_OPS:
            assert self.actor is not None, "refused above before init_model"
            options = ActorOptions.from_json(header.get("options", {})) if op == "update_actor" else None
            check_batch(tensors, self.actor.needed_tensors(op, options), self.world_size, self.actor.vocab_size)
        if op in ("save_checkpoint", "load_checkpoint", "export_hf"):
            path = header.get("options", {}).get("path")
            if not isinstance(path, str) or not path:
                raise BatchError(f"{op} needs options.path, a directory on rank 0's file system; got {path!r}")
        if op == "init_model":
            ModelOptions.from_json(header.get("options", {}))
        if op in ENGINE_OPS:
            assert self.datum_ops is not None, "refused above before init_model"
            self.datum_ops.check(op, header.get("options", {}), tensors)

    def _execute(self, command: dict[str, Any]) -> str:
        """Run one op on every rank; rank 0 replies. Returns the op's name."""
        header, tensors, identity = self._share_header(command)
        op = header.get("op", "skip")
        error: str | None = None
        result: tuple[dict[str, Any], dict[str, torch.Tensor]] = ({}, {})
        try:
            if op in BATCH_OPS:
                shard = self._scatter(header, tensors)
            elif op in DATUM_OPS:
                shard = self._broadcast(header, tensors)
            else:
                shard = {}
            result = self._run(op, header, shard)
        except Exception:  # noqa: BLE001 - every rank's failure is reported to the driver
            error = traceback.format_exc()
            logger.error("rank %d: %s failed:\n%s", self.rank, op, error)
        failures = self._gather_errors(error)
        if self.rank == 0 and identity is not None:
            reply: dict[str, Any] = {"kind": "result", "op_id": header["op_id"]}
            if failures:
                rank, text = failures[0]
                cause = text.strip().splitlines()[-1] if text.strip() else "no traceback"
                reply = {"kind": "error", "op_id": header["op_id"], "error": f"rank {rank} raised during {op}: {cause}"}
                wire.send(self.data, reply, key=self.key, prefix=[identity])
            else:
                wire.send(self.data, {**reply, **result[0]}, result[1], key=self.key, prefix=[identity])
        if op == "destroy":
            dist.destroy_process_group()
        return op

    def _share_header(self, command: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor], bytes | None]:
        """Rank 0 picks the stored data of the command's op id and broadcasts its header."""
        header: dict[str, Any] = {"op": "skip"}
        tensors: dict[str, torch.Tensor] = {}
        identity = None
        if self.rank == 0:
            stored = self.pending.pop(str(command.get("op_id")), None)
            if stored is not None:
                identity, message = stored
                tensors = message.tensors
                header = {
                    **message.header,
                    "shapes": {name: list(t.shape) for name, t in tensors.items()},
                    "dtypes": {name: str(t.dtype).removeprefix("torch.") for name, t in tensors.items()},
                }
        encoded = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8) if self.rank == 0 else None
        length = torch.tensor([encoded.numel() if encoded is not None else 0], dtype=torch.int64)
        dist.broadcast(length, 0)
        buffer = encoded if encoded is not None else torch.empty(int(length[0]), dtype=torch.uint8)
        dist.broadcast(buffer, 0)
        return json.loads(bytes(buffer.numpy())), tensors, identity

    def _scatter(self, header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each rank's rows of every tensor (rank 0 splits; B divides by the world size)."""
        from nexrl_fsdp.direct_zmq.wire import DTYPES

        shard = {}
        for name, shape in header["shapes"].items():
            rows = shape[0] // self.world_size
            out = torch.empty([rows, *shape[1:]], dtype=DTYPES[header["dtypes"][name]])
            pieces = list(tensors[name].clone().chunk(self.world_size)) if self.rank == 0 else None
            dist.scatter(out, pieces, src=0)
            shard[name] = out
        return shard

    def _broadcast(self, header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every tensor, whole, on every rank."""
        from nexrl_fsdp.direct_zmq.wire import DTYPES

        whole = {}
        for name, shape in header["shapes"].items():
            tensor = tensors[name].clone() if self.rank == 0 else torch.empty(shape, dtype=DTYPES[header["dtypes"][name]])
            dist.broadcast(tensor, 0)
            whole[name] = tensor
        return whole

    def _gather_errors(self, error: str | None) -> list[tuple[int, str]]:
        """Every rank's traceback (empty when all succeeded), on every rank."""
        flag = torch.tensor([1 if error else 0], dtype=torch.int64)
        dist.all_reduce(flag)
        if int(flag[0]) == 0:
            return []
        text = (error or "").encode()[-_ERROR_BYTES:]
        mine = torch.zeros(_ERROR_BYTES + 8, dtype=torch.uint8)
        mine[:8] = torch.tensor([len(text)], dtype=torch.int64).view(torch.uint8)
        mine[8 : 8 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8) if text else mine[8:8]
        everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(everyone, mine)
        failures = []
        for rank, row in enumerate(everyone):
            size = int(row[:8].view(torch.int64)[0])
            if size:
                failures.append((rank, bytes(row[8 : 8 + size].numpy()).decode(errors="replace")))
        return failures

    def _run(self, op: str, header: dict[str, Any], shard: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        options = header.get("options", {})
        if op == "init_model":
            self.actor = FsdpActor(ModelOptions.from_json(options), self.mesh, self.device)
            self.datum_ops = DatumOps(self.actor)
            info = {
                "world_size": self.world_size,
                "vocab_size": self.actor.vocab_size,
                "pad_token_id": self.actor.pad_id,
                "dtype": str(self.actor.compute_dtype).removeprefix("torch."),
                "device": self.device.type,
            }
            if self.actor.options.mixed_precision:  # the masters, read from what the optimizer steps
                info["master_dtype"] = str(self.actor.optimizer.parameters[0].dtype).removeprefix("torch.")
            return info, {}
        if op in ("barrier", "destroy", "skip"):
            dist.barrier()
            return {}, {}
        actor, datum_ops = self.actor, self.datum_ops
        if actor is None or datum_ops is None:
            # Rank 0 refuses these ops before init_model (`_check`), but this rank's own init_model may have failed.
            raise BatchError("the model is not initialised on this rank; call init_model first")
        if op in ENGINE_OPS:
            return datum_ops.run(op, options, shard)
        if op == "update_actor":
            return {"metrics": actor.update(shard, ActorOptions.from_json(options))}, {}
        if op in ("compute_log_prob", "compute_ref_log_prob"):
            limits = ActorOptions.from_json(
                {key: options[key] for key in ("micro_batch_rows", "max_tokens_per_microbatch") if key in options}
            )
            local = actor.log_probs(shard, op == "compute_ref_log_prob", limits.micro_batch_rows, limits.max_tokens_per_microbatch)
            gathered = [torch.empty_like(local) for _ in range(self.world_size)] if self.rank == 0 else None
            dist.gather(local, gathered, dst=0)
            return {}, ({"log_probs": torch.cat(gathered)} if gathered is not None else {})
        if op == "get_weights":
            weights = actor.full_weights()
            return {}, (weights if self.rank == 0 else {})
        if op == "push_weights":
            weights = actor.full_weights()
            if self.rank == 0:
                push_weights(self.context, options["endpoint"], weights, header["op_id"], float(options["timeout_s"]), key=self.key)
            return {"parameters": len(weights)}, {}
        if op == "save_checkpoint":
            path = Path(options["path"])
            path.mkdir(parents=True, exist_ok=True)
            actor.save(path)
            return {"path": str(path)}, {}
        if op == "load_checkpoint":
            actor.load(Path(options["path"]))
            return {"path": options["path"]}, {}
        if op == "export_hf":
            actor.export_hf(Path(options["path"]))
            return {"path": options["path"]}, {}
        raise BatchError(f"unknown op {op!r}")

    def report_failure(self, error: BaseException) -> None:
        """Tell the API server why this rank is about to exit (the exception's last line),
        so the driver names it at once; best effort, the log has the traceback."""
        line = "".join(traceback.format_exception_only(type(error), error)).strip().splitlines()[-1][:3000]
        try:
            _http(f"{self.api}/groups/{self.identifier}/failed", self.key, {"rank": self.rank, "error": line}, timeout=5)
        except (OSError, ValueError):
            logger.warning("rank %d: could not report its failure to the API server", self.rank)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.terminate()
            self.watchdog.wait()
        self.context.destroy(linger=0)
