"""The ops a local service runs on a model's worker group: the engine's surface on FSDP ranks.

A Tinker or Weaver service trains each model through `Engine`-shaped calls: ``forward``
and ``forward_backward`` on Tinker datums (gradients add up over calls until the next
step), ``optim_step`` with one request's AdamW settings, the training state saved and
loaded in the engine's checkpoint format (so a model's state moves freely between an
in-process engine and a group of any size). These are those calls on an `FsdpActor`.

The math is the engine's: `loss_fns.check_datums`, `split_microbatches`, `collate`,
`shared_prefix.chunk_logprobs`, the registered loss with the whole request's `StepTotals`, and the
engine's `MetricSum`. The datums are split over the ranks in contiguous parts of about
equal token counts; every rank runs as many micro-batches as the busiest one (FSDP's
collectives need every rank in every pass), the others a one-token datum of weight 0,
which adds nothing. FSDP averages gradients over ranks, so each loss is multiplied by
the world size. Metrics and per-datum logprobs are combined on rank 0.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import attrs
import torch
import torch.distributed as dist

from nexrl_core.config.adamw import AdamWSettings
from nexrl_core.http.serving import DEFAULT_MAX_TOKENS_PER_MICROBATCH
from nexrl_engine import checkpoint as ckpt
from nexrl_engine.engine import MetricSum
from nexrl_engine.loading import SHIPPED_MODELS
from nexrl_engine.loss_fns import (
    ADDITIVE_METRICS,
    CheckedDatum,
    LossFn,
    additive_reduction,
    build_loss_fn,
    check_datums,
    collate,
    policy_loss_inputs,
    step_totals,
)
from nexrl_fsdp.direct_zmq.datums import tensor_datums
from nexrl_fsdp.worker.actor import FsdpActor
from nexrl_fsdp.worker.passes import aligned_passes

__all__ = ["ENGINE_OPS", "DatumOps", "ForwardOptions", "rank_shares"]

ENGINE_OPS = frozenset({"forward", "optim_step", "save_state", "load_state"})
"""The ops `DatumOps` runs."""
_STATE_FLAGS = {"save_state": "include_optimizer", "load_state": "load_optimizer"}


@attrs.frozen(kw_only=True)
class ForwardOptions:
    """The options of a ``forward`` op."""

    loss_fn: str
    loss_fn_config: dict[str, Any] = attrs.field(factory=dict)
    backward: bool = False
    """Back-propagate (gradients add up until ``optim_step``)."""
    max_tokens_per_microbatch: int = DEFAULT_MAX_TOKENS_PER_MICROBATCH
    """As `EngineConfig.max_tokens_per_microbatch`: padded tokens per pass on a rank."""

    @classmethod
    def from_json(cls, values: Mapping[str, Any]) -> ForwardOptions:
        known = {field.name for field in attrs.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown forward options {unknown}; valid: {', '.join(sorted(known))}")
        options = cls(**values)
        if not isinstance(options.backward, bool):
            raise ValueError(f"forward option backward must be true or false, got {options.backward!r}")
        size = options.max_tokens_per_microbatch
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"forward option max_tokens_per_microbatch must be an integer >= 1, got {size!r}")
        return options


def rank_shares(lengths: Sequence[int], world_size: int) -> list[range]:
    """Each rank's datums: contiguous, in order, of about equal token counts. Rank 0
    always has one (its metric names are the request's); another rank may get none
    when there are fewer datums than ranks."""
    total = sum(lengths)
    ends = list(itertools.accumulate(lengths))
    shares, start = [], 0
    for rank in range(world_size):
        if rank == world_size - 1:
            stop = len(lengths)
        else:
            target = total * (rank + 1) / world_size
            stop = start + 1 if rank == 0 else start
            while stop < len(lengths) and ends[stop] - lengths[stop] / 2 <= target:
                stop += 1
        shares.append(range(start, stop))
        start = stop
    return shares


class DatumOps:
    """The engine-shaped ops on one rank's share of the policy."""

    def __init__(self, actor: FsdpActor) -> None:
        self.actor = actor
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._losses: dict[str, LossFn] = {}
        self.base_model_id = actor.options.model if actor.options.model in SHIPPED_MODELS else str(actor.model_dir)
        """How checkpoints name the base model (as `Engine.base_model_id`)."""
        self.lora_record = actor.options.lora.to_json() if actor.is_lora else None
        """How checkpoints record the LoRA settings (as `Engine.save_state`; None: every weight trains)."""

    # --- checks (rank 0, before any rank sees the op) -------------------------------------------

    def loss_fn(self, options: ForwardOptions) -> LossFn:
        key = json.dumps([options.loss_fn, options.loss_fn_config], sort_keys=True, default=str)
        if key not in self._losses:
            self._losses[key] = build_loss_fn(options.loss_fn, options.loss_fn_config)
        return self._losses[key]

    def checked(self, options: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> tuple[ForwardOptions, LossFn, list[CheckedDatum]]:
        """A ``forward`` op's options, loss and datums, checked as the engine checks them.

        :raises ValueError: naming the option, datum or key that is wrong.
        """
        forward = ForwardOptions.from_json(options)
        loss = self.loss_fn(forward)
        return forward, loss, check_datums(tensor_datums(tensors), loss, self.actor.vocab_size)

    def check(self, op: str, options: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
        """Refuse an op whose input is wrong before any rank runs it (rank 0).

        :raises ValueError: naming what is wrong; a checkpoint to load is read and
            matched against the model, so a wrong one is refused by name.
        """
        if op == "forward":
            self.checked(options, tensors)
        elif op == "optim_step":
            try:
                AdamWSettings(**options)
            except TypeError:
                valid = ", ".join(field.name for field in attrs.fields(AdamWSettings))
                raise ValueError(f"optim_step options {sorted(options)} are not AdamW fields; valid: {valid}") from None
        elif op in _STATE_FLAGS:
            flag = _STATE_FLAGS[op]
            if not isinstance(options.get("path"), str) or not options["path"]:
                raise ValueError(f"{op} needs options.path, a directory")
            if not isinstance(options.get(flag), bool):
                raise ValueError(f"{op} needs options.{flag}, true or false")
            if op == "load_state":
                self._read_state(Path(options["path"]), options[flag])

    def run(
        self, op: str, options: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Run one of `ENGINE_OPS` on every rank; the header and tensors rank 0 answers."""
        if op == "forward":
            return self.forward(options, tensors)
        if op == "optim_step":
            return self.optim_step(options), {}
        if op == "save_state":
            return self.save_state(options), {}
        return self.load_state(options), {}

    # --- forward / forward_backward ---------------------------------------------------------------

    def forward(self, options: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The loss, metrics and per-datum target logprobs of the datums; with
        ``backward`` their gradients are added to the accumulated ones."""
        forward, loss, datums = self.checked(options, tensors)
        actor = self.actor
        totals = step_totals(datums)
        shares = rank_shares([len(d.input_tokens) for d in datums], self.world_size)
        mine = [datums[index] for index in shares[self.rank]]
        keys = {key for datum in datums for key in datum.values}
        passes = aligned_passes(mine, max_tokens=forward.max_tokens_per_microbatch, max_rows=None, pad_id=actor.pad_id, keys=keys)
        metrics = MetricSum(ADDITIVE_METRICS, additive_reduction(loss))
        logprobs: list[torch.Tensor] = []
        tokens = 0.0
        actor.model.train(False)
        with torch.set_grad_enabled(forward.backward):
            for one in passes:
                batch = collate(one.datums, actor.pad_id, actor.device)
                values, entropy = actor.chunk_logprobs(actor.model, one.datums, batch, loss.needs_entropy)
                result = loss.loss(policy_loss_inputs(batch, values, entropy, totals))
                if forward.backward:
                    (result.loss * self.world_size).backward()
                if one.idle:
                    continue
                weight = float(batch.loss_mask.sum())
                tokens += weight
                metrics.add({"loss": float(result.loss.detach()), **result.metrics}, weight)
                detached = values.detach().to("cpu")
                logprobs.extend(detached[slot, :n] for slot, n in enumerate(batch.lengths))
        reduced = self._reduced(metrics)
        reduced["num_tokens:sum"] = self._all_sum(tokens)
        reduced["num_sequences:sum"] = float(len(datums))
        flat = torch.cat(logprobs) if logprobs else torch.empty(0, dtype=torch.float32)
        sizes = [sum(len(datums[i].input_tokens) for i in share) for share in shares]
        gathered = self._gather_flat(flat.to(torch.float32), sizes)
        return {"metrics": reduced}, ({"logprobs": gathered} if self.rank == 0 else {})

    def _reduced(self, metrics: MetricSum) -> dict[str, float]:
        """Rank 0's metric names with every rank's micro-batches combined: sums and
        token-weighted means added up, minima and maxima taken over ranks."""
        names = _broadcast_json(sorted(metrics.values), self.rank)
        values = torch.tensor([_own_value(metrics, name) for name in names], dtype=torch.float64)
        weights = torch.tensor([metrics.weights.get(name, 0.0) for name in names], dtype=torch.float64)
        added = [i for i, name in enumerate(names) if not name.endswith((":min", ":max"))]
        if added:
            part = torch.stack([values[added], weights[added]])
            dist.all_reduce(part)
            values[added], weights[added] = part[0], part[1]
        for suffix, op in ((":min", dist.ReduceOp.MIN), (":max", dist.ReduceOp.MAX)):
            picked = [i for i, name in enumerate(names) if name.endswith(suffix)]
            if picked:
                part = values[picked].clone()
                dist.all_reduce(part, op=op)
                values[picked] = part
        return {
            name: float(values[i] / weights[i]) if name.endswith(":mean") and weights[i] > 0 else float(values[i])
            for i, name in enumerate(names)
        }

    def _gather_flat(self, flat: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Every rank's flat values, in rank order, on rank 0 (empty elsewhere)."""
        width = max(max(sizes), 1)
        padded = torch.zeros(width, dtype=flat.dtype)
        padded[: flat.numel()] = flat
        parts = [torch.empty_like(padded) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(padded, parts, dst=0)
        if parts is None:
            return torch.empty(0, dtype=flat.dtype)
        return torch.cat([part[:size] for part, size in zip(parts, sizes)])

    def _all_sum(self, value: float) -> float:
        tensor = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(tensor)
        return float(tensor[0])

    # --- optimizer --------------------------------------------------------------------------------

    def optim_step(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """One AdamW step on the accumulated gradients (then zeroed), as `Engine.optim_step`."""
        result = self.actor.optimizer.step(AdamWSettings(**options))
        return attrs.asdict(result)

    # --- training state in the engine's checkpoint format -----------------------------------------

    def trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(name, p) for name, p in self.actor.model.named_parameters() if p.requires_grad]

    def save_state(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """The trainable weights (and with ``include_optimizer`` the AdamW state),
        gathered whole and written by rank 0 as `Engine.save_state` writes them."""
        path, include_optimizer = Path(options["path"]), bool(options["include_optimizer"])
        with torch.no_grad():
            weights = {name: _whole(p.detach()) for name, p in self.trainable()}
            optimizer_state = None
            if include_optimizer:
                optimizer_state = {name: _whole(t) for name, t in self.actor.optimizer.state_tensors().items()}
        if self.rank == 0:
            manifest = ckpt.CheckpointManifest(
                base_model=self.base_model_id,
                dtype=self.actor.options.dtype,
                lora=self.lora_record,
                step=self.actor.optimizer.steps,
                has_optimizer=include_optimizer,
                parameters=list(weights),
            )
            ckpt.write_checkpoint(path, manifest, weights, optimizer_state)
        dist.barrier()
        return {"path": str(path), "step": self.actor.optimizer.steps}

    def _read_state(self, path: Path, load_optimizer: bool) -> ckpt.LoadedState:
        return ckpt.read_for_loading(
            path,
            base_model=self.base_model_id,
            lora=self.lora_record,
            shapes={name: tuple(p.shape) for name, p in self.trainable()},
            load_optimizer=load_optimizer,
        )

    def load_state(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """Load an engine-format checkpoint (every rank reads it and keeps its shard);
        with ``load_optimizer`` also the AdamW moments and step count, otherwise the
        optimizer starts fresh. Accumulated gradients are dropped."""
        path, load_optimizer = Path(options["path"]), bool(options["load_optimizer"])
        loaded = self._read_state(path, load_optimizer)
        own = dict(self.trainable())
        optimizer = self.actor.optimizer
        optimizer.zero_grad()
        with torch.no_grad():
            for name, tensor in loaded.weights.items():
                own[name].copy_(_like(tensor, own[name]))
            state = loaded.optimizer_state or {}
            optimizer.load_state_tensors(
                {key: _like(value, own[key.rpartition("::")[0]]) if value.dim() else value for key, value in state.items()},
                loaded.manifest.step if loaded.optimizer_state is not None else 0,
            )
        dist.barrier()
        return {"path": str(path), "step": optimizer.steps}


def _own_value(metrics: MetricSum, name: str) -> float:
    """This rank's value of ``name``; a rank without it adds nothing to the combination."""
    if name in metrics.values:
        return metrics.values[name]
    if name.endswith(":min"):
        return float("inf")
    if name.endswith(":max"):
        return float("-inf")
    return 0.0


def _broadcast_json(value: Any, rank: int) -> Any:
    """Rank 0's ``value`` on every rank."""
    encoded = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8) if rank == 0 else None
    length = torch.tensor([encoded.numel() if encoded is not None else 0], dtype=torch.int64)
    dist.broadcast(length, 0)
    buffer = encoded if encoded is not None else torch.empty(int(length[0]), dtype=torch.uint8)
    dist.broadcast(buffer, 0)
    return json.loads(bytes(buffer.numpy()))


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A (possibly sharded) tensor gathered whole, on the CPU (every rank takes part)."""
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return full.detach().to("cpu").contiguous()


def _like(tensor: torch.Tensor, parameter: torch.Tensor) -> torch.Tensor:
    """A whole tensor as ``parameter`` holds it: its dtype and device, and this rank's
    shard of it when the parameter is sharded (cut locally: every rank has the whole)."""
    tensor = tensor.to(device=parameter.device, dtype=parameter.dtype)
    if not hasattr(parameter, "device_mesh"):
        return tensor
    from torch.distributed.tensor import DTensor, distribute_tensor

    sharded = cast(DTensor, parameter)  # a parameter with a device mesh is one FSDP2 shards, a DTensor
    return distribute_tensor(tensor, sharded.device_mesh, sharded.placements, src_data_rank=None)
