"""`DirectZmqTransport`: a trainer's client of one worker group (the ``direct-zmq`` transport).

Every op is two phases: the op's header and tensors go straight to rank 0's data socket
and rank 0 answers ACK (or why it refuses them); then the API server broadcasts
"execute" and rank 0 sends the result back on the same socket. While it waits, the
client asks the API server whether the group is still alive, so a dead rank is an
error naming it within seconds, and every wait has a timeout from the config. Every
call to the API server carries the group's key as a bearer token and every message to
and from rank 0 its MAC (`DirectZmqOptions.key`); a reply without it is dropped and logged.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import zmq

from nexrl_core.config.lora import LoraSettings
from nexrl_core.training.backend import BackendLost
from nexrl_fsdp.direct_zmq import wire
from nexrl_fsdp.direct_zmq.group_key import bearer_header
from nexrl_fsdp.direct_zmq.options import DirectZmqOptions
from nexrl_fsdp.direct_zmq.protocol import BATCH_TENSORS, OPTIONAL_BATCH_TENSORS

if TYPE_CHECKING:
    from nexrl_core.training.batch import Batch

__all__ = ["DirectZmqOptions", "DirectZmqTransport", "WorkerGroupError", "WorkerGroupLost"]

logger = logging.getLogger(__name__)

_POLL_S = 0.25
WORKER_TENSORS = frozenset(BATCH_TENSORS) | frozenset(OPTIONAL_BATCH_TENSORS)
_STATUS_EVERY_S = 1.0
DESTROY_TIMEOUT_S = 20.0
"""How long a shutdown waits for a group to acknowledge ``destroy`` (ranks finish the op
they are in first: a save of the tiny model takes a second or two, of a large one more)."""


class WorkerGroupError(RuntimeError):
    """The worker group refused an op, failed in it, died, or did not answer in time."""


class OpRefused(WorkerGroupError, ValueError):
    """Rank 0 refused an op's input before any rank ran it (the message says why); a
    ValueError too, since the request, not the group, was wrong."""


class WorkerGroupLost(WorkerGroupError, BackendLost):
    """The group died (a rank stopped beating) or stopped making progress (an op past its
    deadline, e.g. a rank stuck in a collective whose peer died): it must be restarted."""


class DirectZmqTransport:
    """Drives one worker group; not thread-safe (one op at a time)."""

    def __init__(self, options: DirectZmqOptions) -> None:
        self.options = options
        self.api = options.api_server_url.rstrip("/") + "/api/v1"
        self.context = zmq.Context()
        self.socket: Any = None
        self.group_info: dict[str, Any] = {}
        self._spent_s = 0.0

    # --- HTTP to the API server ---------------------------------------------------------

    def _http(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> dict[str, Any]:
        request = urllib.request.Request(
            self.api + path,
            data=None if body is None else json.dumps(body).encode(),
            method=method,
            headers={"content-type": "application/json", **bearer_header(self.options.key)},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            raise WorkerGroupError(f"workers API {method} {path} answered {error.code}: {error.read().decode(errors='replace')}") from None
        except OSError as error:
            raise WorkerGroupError(f"the workers API at {self.options.api_server_url} is unreachable: {error}") from None

    def info(self) -> dict[str, Any]:
        """The group as the API server sees it (status, endpoints, missing ranks)."""
        return self._http("GET", f"/groups/{self.options.identifier}")

    # --- lifecycle ------------------------------------------------------------------------

    def initialize_worker(self) -> dict[str, Any]:
        """Register the group and wait until every rank has reported its endpoint.

        :raises WorkerGroupError: naming the ranks still missing after ``connect_timeout_s``.
        """
        self._http("POST", "/groups", {"identifier": self.options.identifier, "world_size": self.options.world_size})
        deadline = time.monotonic() + self.options.connect_timeout_s
        while True:
            info = self.info()
            if info["status"] == "ready":
                break
            if info["status"] in ("dead", "destroyed"):
                raise WorkerGroupError(
                    f"worker group {self.options.identifier!r} is {info['status']}: {info['reason']}{self._output_hint()}"
                )
            if time.monotonic() > deadline:
                missing = info["missing_ranks"]
                raise WorkerGroupError(
                    f"only {self.options.world_size - len(missing)}/{self.options.world_size} workers have reported endpoints "
                    f"after {self.options.connect_timeout_s:.0f} s: missing rank{'s' if len(missing) > 1 else ''} "
                    f"{', '.join(map(str, missing))}"
                )
            time.sleep(0.1)
        self.group_info = info
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.SNDBUF, 1 << 23)
        self.socket.setsockopt(zmq.RCVBUF, 1 << 23)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(info["endpoints"]["0"])
        return info

    def init_model(
        self,
        model: str,
        dtype: str = "float32",
        seed: int = 0,
        lora: LoraSettings | None = None,
        gradient_checkpointing: bool = False,
        mixed_precision: bool = False,
    ) -> dict[str, Any]:
        """Load (and shard) the model on every rank, training every weight or the LoRA
        adapters ``lora`` asks for, checkpointing activations in updates when
        ``gradient_checkpointing``, and with ``mixed_precision`` keeping fp32 master shards
        under ``dtype`` (bfloat16) compute; returns its vocab size, pad id, the dtype the
        model computes in (``dtype``; with mixed precision also ``master_dtype``) and the
        ranks' device type."""
        options = {"model": model, "dtype": dtype, "seed": seed, "lora": (lora or LoraSettings()).to_json()}
        if gradient_checkpointing:
            options["gradient_checkpointing"] = True
        if mixed_precision:
            options["mixed_precision"] = True
        return self._call("init_model", options).header

    def update_actor(self, batch: Batch, options: Mapping[str, Any]) -> dict[str, float]:
        """Train on ``batch`` (needs ``loss_mask`` and what the loss needs); returns metrics."""
        reply = self._call("update_actor", dict(options), self._batch_tensors(batch))
        return {key: float(value) for key, value in reply.header["metrics"].items()}

    def compute_log_prob(self, batch: Batch, micro_batch_rows: int = 8, max_tokens_per_microbatch: int | None = None) -> torch.Tensor:
        """[B, L] logprobs of the current policy (0 on padding and each row's first token)."""
        return self._log_probs("compute_log_prob", batch, micro_batch_rows, max_tokens_per_microbatch)

    def compute_ref_log_prob(self, batch: Batch, micro_batch_rows: int = 8, max_tokens_per_microbatch: int | None = None) -> torch.Tensor:
        """[B, L] logprobs of the frozen reference (the base weights)."""
        return self._log_probs("compute_ref_log_prob", batch, micro_batch_rows, max_tokens_per_microbatch)

    def get_weights(self) -> dict[str, torch.Tensor]:
        """Every parameter of the policy, whole, by name (for a sampler)."""
        return self._call("get_weights", {}).tensors

    def push_weights(self, endpoint: str) -> int:
        """Gather the policy on rank 0 and send it from there straight to the sampler
        process at ``endpoint`` (it must be reachable from rank 0); returns once the
        sampler has loaded it, with the number of parameters sent."""
        options = {"endpoint": endpoint, "timeout_s": self.options.op_timeout_s}
        return int(self._call("push_weights", options).header["parameters"])

    def forward(self, datums: Mapping[str, torch.Tensor], options: Mapping[str, Any]) -> wire.Message:
        """Loss, metrics and per-datum target logprobs of Tinker-shaped ``datums`` (as
        `nexrl_fsdp.direct_zmq.datums.datum_tensors` encodes them); ``options`` are
        `nexrl_fsdp.worker.datum_ops.ForwardOptions`' fields. With ``backward`` the
        gradients add up on the ranks until `optim_step`. The reply's header has the
        metrics, its ``logprobs`` tensor every datum's values one after the other."""
        return self._call("forward", dict(options), dict(datums))

    def optim_step(self, settings: Mapping[str, float]) -> dict[str, Any]:
        """One AdamW step (`AdamWSettings` fields) on the accumulated gradients; returns
        `OptimStepResult`'s fields."""
        return self._call("optim_step", dict(settings)).header

    def save_state(self, path: str, include_optimizer: bool) -> dict[str, Any]:
        """The trainable weights (and the AdamW state) in the engine's checkpoint format."""
        return self._call("save_state", {"path": str(path), "include_optimizer": include_optimizer}).header

    def load_state(self, path: str, load_optimizer: bool) -> dict[str, Any]:
        """Load a checkpoint in the engine's format (refused if it does not match the model)."""
        return self._call("load_state", {"path": str(path), "load_optimizer": load_optimizer}).header

    def save_checkpoint(self, path: str) -> str:
        """Sharded model and optimizer state (torch.distributed.checkpoint) under ``path``."""
        return str(self._call("save_checkpoint", {"path": str(path)}).header["path"])

    def load_checkpoint(self, path: str) -> None:
        self._call("load_checkpoint", {"path": str(path)})

    def export_hf(self, path: str) -> str:
        """The policy as `Engine.export_hf` writes it (a plain HF directory; for LoRA the
        adapters merged in and the adapter in PEFT layout beside), written by rank 0 at ``path``."""
        return str(self._call("export_hf", {"path": str(path)}).header["path"])

    def barrier(self) -> None:
        self._call("barrier", {})

    def destroy(self) -> None:
        """End the worker group (every rank exits) and forget it on the API server.

        Waits at most ``DESTROY_TIMEOUT_S`` (or the op timeout, if shorter) for the ranks
        to acknowledge: it runs while a run or a service shuts down, and a group that does
        not answer by then is ended by its launcher's stop instead of holding the
        shutdown for a whole op timeout."""
        try:
            self._call("destroy", {}, limit_s=DESTROY_TIMEOUT_S)
        finally:
            try:
                self._http("DELETE", f"/groups/{self.options.identifier}")
            except WorkerGroupError:
                pass

    def close(self) -> None:
        """Release this client's sockets (the workers keep running)."""
        if self.socket is not None:
            self.socket.close(linger=0)
            self.socket = None
        self.context.term()

    # --- internals ------------------------------------------------------------------------

    def _batch_tensors(self, batch: Batch) -> dict[str, torch.Tensor]:
        """The tensors the workers read (an algorithm's bookkeeping, such as rewards or
        returns, stays here), with rows appended so they divide over the ranks."""
        padded = batch.pad_to_world_size(self.options.world_size)
        return {name: tensor for name, tensor in padded.tensors.items() if name in WORKER_TENSORS}

    def _log_probs(self, op: str, batch: Batch, micro_batch_rows: int, max_tokens_per_microbatch: int | None) -> torch.Tensor:
        limits = {"micro_batch_rows": micro_batch_rows, "max_tokens_per_microbatch": max_tokens_per_microbatch}
        reply = self._call(op, limits, self._batch_tensors(batch))
        return reply.tensors["log_probs"][: batch.batch_size].clone()

    def _call(
        self, op: str, options: Mapping[str, Any], tensors: Mapping[str, torch.Tensor] | None = None, limit_s: float | None = None
    ) -> wire.Message:
        if self.socket is None:
            raise WorkerGroupError("the transport is not connected; call initialize_worker first")
        started = time.monotonic()
        limit = self.options.op_timeout_s if limit_s is None else min(limit_s, self.options.op_timeout_s)
        if self.options.total_timeout_s is not None:
            limit = min(limit, self.options.total_timeout_s - self._spent_s)
            if limit <= 0:
                raise WorkerGroupError(f"the transport's total timeout of {self.options.total_timeout_s:.0f} s is spent")
        deadline = started + limit
        op_id = uuid.uuid4().hex
        try:
            wire.send(self.socket, {"op": op, "op_id": op_id, "options": dict(options)}, tensors, key=self.options.key)
            ack = self._await(op, op_id, deadline, "to acknowledge its data")
            if ack.header.get("kind") == "refused":
                raise OpRefused(ack.header["error"])
            self._execute(op, op_id)
            reply = self._await(op, op_id, deadline, "to finish")
            if reply.header.get("kind") == "error":
                raise WorkerGroupError(reply.header["error"] + self._output_hint())
            return reply
        finally:
            self._spent_s += time.monotonic() - started

    def _execute(self, op: str, op_id: str) -> None:
        """Have the API server tell every rank to run ``op_id``. A group it has called dead
        meanwhile (a rank, its watchdog or the launcher gone since the last op) is a lost
        group, which the run answers with a restart, like a death noticed during an op."""
        try:
            self._http("POST", f"/groups/{self.options.identifier}/execute", {"op_id": op_id, "op": op})
        except WorkerGroupError:
            info = self.info()
            if info["status"] in ("dead", "destroyed"):
                raise WorkerGroupLost(
                    f"worker group {self.options.identifier!r} is {info['status']} before {op}: {info['reason']}{self._output_hint()}"
                ) from None
            raise

    def _await(self, op: str, op_id: str, deadline: float, what: str) -> wire.Message:
        """The next message for ``op_id``; checks the group's liveness while waiting."""
        next_check = time.monotonic() + _STATUS_EVERY_S
        while True:
            if self.socket.poll(int(_POLL_S * 1000)):
                try:
                    _, message = wire.recv(self.socket, key=self.options.key)
                except wire.UnauthenticatedMessage as error:
                    logger.warning("worker group %r: dropped a reply: %s", self.options.identifier, error)
                    continue
                if message.header.get("op_id") == op_id:
                    return message
                continue  # a late answer to an op that timed out earlier
            now = time.monotonic()
            if now > deadline:
                raise WorkerGroupLost(
                    f"worker group {self.options.identifier!r} did not answer {op} {what} within the op timeout "
                    f"({self.options.op_timeout_s:g} s){self._output_hint()}"
                )
            if now >= next_check:
                next_check = now + _STATUS_EVERY_S
                info = self.info()
                if info["status"] in ("dead", "destroyed"):
                    raise WorkerGroupLost(
                        f"worker group {self.options.identifier!r} is {info['status']} during {op}: {info['reason']}{self._output_hint()}"
                    )

    def _output_hint(self) -> str:
        return f" (the ranks' output: {self.options.log_path})" if self.options.log_path else ""
