"""One rank's share of the policy: the model sharded with FSDP2, its optimizer and its ops.

The math is the engine's: datums from `rows`, `loss_fns.collate` / `shared_prefix.chunk_logprobs` /
`policy_loss_inputs`, the registered loss built by `loss_fns.build_loss_fn`, and the
engine's `AdamW` (clipping, the skip on a non-finite norm). What is added is the data
parallelism: every rank runs the same passes on its rows, and each pass's loss is divided
by the mini-batch's totals over all ranks (`StepTotals`: trained tokens, sequences,
longest row), so the passes of all ranks add up to the loss one process computes on the
whole mini-batch, in every aggregation mode. FSDP averages gradients over ranks; the loss
is multiplied by the world size to undo it.

LoRA is the engine's too: `nexrl_engine.lora.apply_training_mode` injects the adapters the
`LoraSettings` record asks for into the model on the CPU (same seed, same adapters as
the engine) before FSDP2 shards it, so frozen base weights and trainable adapters share
each layer's unit and only the adapters get gradients and optimizer state. Rank 0 keeps
an unsharded CPU copy of the adapted model: its base never changes, so exporting or
handing weights to a sampler gathers only the adapters into it and merges there
(`merged_copy`, `save_adapter`), exactly as `Engine.export_hf` writes them.

Mixed precision (``ModelOptions.mixed_precision``, ``model.mixed_precision``) is FSDP2's
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` on fp32 shards of
what trains: each forward gathers the shards as bfloat16, the backward pass reduces the
gradients in fp32 onto them, and the optimizer steps fp32 masters with fp32 moments, as
`nexrl_engine.mixed_precision.MasterWeights` does on the engine. A LoRA base that never
trains is bfloat16 alone. Weights that leave the ranks (pushed to a sampler, gathered,
exported) are the bfloat16 ones the model computes with; checkpoints hold the fp32 shards.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol, cast

import attrs
import torch
import torch.distributed as dist

from nexrl_core.config.adamw import AdamWSettings
from nexrl_core.config.lora import LoraSettings
from nexrl_core.training.algorithms import StepTotals
from nexrl_core.training.model_export import ADAPTER_DIR
from nexrl_engine.checkpointing import enable_checkpointing, is_checkpointing, training_pass
from nexrl_engine.engine import MetricSum
from nexrl_engine.loading import load_model, load_tokenizer, quiet_progress, resolve_model_dir, save_hf_directory, torch_dtype
from nexrl_engine.lora import adapters_disabled, apply_training_mode, merged_copy, save_adapter
from nexrl_engine.loss_fns import (
    ADDITIVE_METRICS,
    CheckedDatum,
    LossFn,
    PaddedBatch,
    additive_reduction,
    build_loss_fn,
    collate,
    policy_loss_inputs,
    step_totals,
)
from nexrl_engine.mixed_precision import COMPUTE_DTYPE, MASTER_DTYPE, cast_parameters
from nexrl_engine.optim import AdamW
from nexrl_engine.shared_prefix import chunk_logprobs, plan_prefix_sharing
from nexrl_fsdp.worker.passes import aligned_passes
from nexrl_fsdp.worker.rows import BatchError, row_datums, scatter_back

__all__ = ["HF_EXPORT_DIR", "ActorOptions", "FsdpActor", "ModelOptions"]

logger = logging.getLogger(__name__)

_STEP_FILE = "nexrl_actor.json"
HF_EXPORT_DIR = "hf"
"""Where, in a worker checkpoint, the policy is written as a plain Hugging Face directory."""


def _lora_settings(value: Any) -> LoraSettings:
    if isinstance(value, LoraSettings):
        return value
    if not isinstance(value, Mapping):
        raise BatchError(f"init_model option lora must be an object of LoraSettings fields, got {value!r}")
    known = {field.name for field in attrs.fields(LoraSettings)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise BatchError(f"unknown init_model lora fields {unknown}; valid: {', '.join(sorted(known))}")
    return LoraSettings(**value)


@attrs.frozen(kw_only=True)
class ModelOptions:
    """What ``init_model`` loads."""

    model: str = "nexrl-tiny"
    """A shipped model name or a local HF directory (the same on every node)."""
    dtype: str = "float32"
    seed: int = 0
    """Seeds the rank's RNG and the LoRA adapters' initialisation (as the engine's seed does)."""
    lora: LoraSettings = attrs.field(factory=LoraSettings, converter=_lora_settings)
    """Full fine-tuning (rank 0) or LoRA adapters: the engine's record, applied before sharding."""
    gradient_checkpointing: bool = False
    """Checkpoint each decoder layer in the update's training passes (enabled before
    sharding; ``model.gradient_checkpointing``)."""
    mixed_precision: bool = attrs.field(default=False)
    """fp32 master shards of what trains under bfloat16 compute (FSDP2's policy; ``dtype``
    must be bfloat16; ``model.mixed_precision``)."""

    @mixed_precision.validator
    def _bfloat16_only(self, attribute: attrs.Attribute, value: bool) -> None:
        if value and self.dtype != "bfloat16":
            raise BatchError(
                f"init_model option mixed_precision needs dtype bfloat16 (fp32 masters under bfloat16 compute), got {self.dtype!r}"
            )

    @classmethod
    def from_json(cls, values: Mapping[str, Any]) -> ModelOptions:
        known = {field.name for field in attrs.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise BatchError(f"unknown init_model options {unknown}; valid: {', '.join(sorted(known))}")
        return cls(**values)


@attrs.frozen(kw_only=True)
class ActorOptions:
    """How ``update_actor`` trains on a batch."""

    loss_fn: str = "importance_sampling"
    """Registered policy loss."""
    loss_fn_config: dict[str, Any] = attrs.field(factory=dict)
    """Its options (``agg_mode``: any aggregation; Tinker's ``token-sum`` by default)."""
    optimizer: AdamWSettings = attrs.field(factory=AdamWSettings)
    ppo_epochs: int = 1
    """Passes over the batch."""
    mini_batches: int = 1
    """Optimizer steps per pass: each rank's rows split into this many equal parts."""
    micro_batch_rows: int = 8
    """Most rows per forward/backward on a rank (gradients accumulate over a mini-batch)."""
    max_tokens_per_microbatch: int | None = None
    """Most padded tokens (rows x longest row) per forward/backward on a rank; None: rows
    alone decide. Ranks whose rows pack into fewer passes run idle ones (`passes`)."""

    @classmethod
    def from_json(cls, values: Mapping[str, Any]) -> ActorOptions:
        values = dict(values)
        known = {field.name for field in attrs.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise BatchError(f"unknown update_actor options {unknown}; valid: {', '.join(sorted(known))}")
        if "optimizer" in values:
            values["optimizer"] = AdamWSettings(**values["optimizer"])
        options = cls(**values)
        for name in ("ppo_epochs", "mini_batches", "micro_batch_rows", "max_tokens_per_microbatch"):
            value = getattr(options, name)
            if value is None and name == "max_tokens_per_microbatch":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise BatchError(f"update_actor option {name} must be an integer >= 1, got {value!r}")
        return options


def _shard(model: torch.nn.Module, mesh: Any, mixed_precision: bool = False) -> torch.dtype | None:
    """FSDP2: each decoder layer its own unit, the rest (embeddings, tied head) the root's;
    with ``mixed_precision`` under ``MixedPrecisionPolicy(param_dtype=bfloat16,
    reduce_dtype=float32)`` (the shards stay as loaded, fp32 for what trains). Returns the
    dtype the policy given to FSDP computes in (None: the parameters' own), which is what
    the ranks report and hand out, so a report cannot say bfloat16 while FSDP computes fp32.

    A lone rank keeps the plain module: sharding over one rank splits nothing, and FSDP's
    hooks, gathers and DTensor dispatch made its steps about 20 % slower (forward/backward)
    and the optimizer's twice as slow on a CPU. Mixed precision is the policy's, so a lone
    rank with it is sharded too. The rest of the worker treats sharded and plain
    parameters alike."""
    if mesh.size() == 1 and not mixed_precision:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=COMPUTE_DTYPE, reduce_dtype=MASTER_DTYPE) if mixed_precision else MixedPrecisionPolicy()
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return policy.param_dtype


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A whole parameter in memory of its own. A parameter FSDP holds unsharded (the root
    module's, after a forward) is FSDP's own buffer, which it frees later by resizing its
    storage; sending that buffer zero-copy exposes it to numpy, which makes the storage
    unresizable for good, and the next backward fails. So it is copied."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.clone()


class _HFModel(Protocol):
    """What the policy, an HF causal LM, has beyond `torch.nn.Module` (whose type does
    not declare it): input embeddings, an `nn.Embedding` in every such model."""

    def get_input_embeddings(self) -> torch.nn.Embedding: ...


class FsdpActor:
    """The policy (and, once asked for, a frozen reference) on this rank."""

    def __init__(self, options: ModelOptions, mesh: Any, device: torch.device) -> None:
        self.options = options
        self.mesh = mesh
        self.device = device
        self.world_size = dist.get_world_size()
        self.model_dir = resolve_model_dir(options.model)
        self.tokenizer = load_tokenizer(self.model_dir)
        torch.manual_seed(options.seed)
        self.model, self._adapted, self.compute_dtype = self._load_policy()
        self.vocab_size = int(cast(_HFModel, self.model).get_input_embeddings().num_embeddings)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (self.tokenizer.eos_token_id or 0))
        self.optimizer = AdamW([(name, p) for name, p in self.model.named_parameters() if p.requires_grad])
        self._reference: torch.nn.Module | None = None
        self._losses: dict[str, LossFn] = {}

    @property
    def is_lora(self) -> bool:
        return self.options.lora.is_lora

    def _load_policy(self) -> tuple[torch.nn.Module, Any, torch.dtype]:
        """The policy, sharded, with only what `LoraSettings` trains requiring gradients;
        for LoRA on rank 0 the unsharded CPU copy of the adapted peft model that
        `_adapted_on_rank_0` brings up to date (None elsewhere and for full fine-tuning);
        and what the policy computes in, which is also what the weights leaving the ranks
        are: bfloat16 over fp32 masters with mixed precision, else the dtype it was loaded in.
        Mixed precision loads fp32 (the checkpoint's own values become the masters) and
        casts what never trains to bfloat16; the CPU copy holds what the model computes
        with, bfloat16."""
        mixed = self.options.mixed_precision
        loaded = MASTER_DTYPE if mixed else torch_dtype(self.options.dtype)
        base = load_model(self.model_dir, loaded, device="cpu")
        model, peft = apply_training_mode(base, self.options.lora, self.options.seed)
        if mixed:
            cast_parameters(model, COMPUTE_DTYPE, frozen_only=True)
        adapted = copy.deepcopy(peft) if peft is not None and dist.get_rank() == 0 else None
        if adapted is not None and mixed:
            cast_parameters(adapted, COMPUTE_DTYPE)
        if self.options.gradient_checkpointing:
            enable_checkpointing(model)
        model.to(self.device)
        return model, adapted, _shard(model, self.mesh, mixed) or loaded

    def _load_base(self) -> torch.nn.Module:
        model = load_model(self.model_dir, torch_dtype(self.options.dtype), device=self.device)
        _shard(model, self.mesh)
        return model

    # --- checks --------------------------------------------------------------------------

    def loss(self, options: ActorOptions) -> LossFn:
        """The registered loss the options name, built with their settings (Tinker's
        ``token-sum`` unless ``agg_mode`` says otherwise)."""
        config = dict(options.loss_fn_config)
        key = json.dumps([options.loss_fn, config], sort_keys=True, default=str)
        if key not in self._losses:
            self._losses[key] = build_loss_fn(options.loss_fn, config)
        return self._losses[key]

    def needed_tensors(self, op: str, options: ActorOptions | None) -> set[str]:
        """The batch tensors ``op`` needs beyond input_ids and attention_mask."""
        if op != "update_actor" or options is None:
            return set()
        loss = self.loss(options)
        return {"loss_mask"} | {name for name in ("old_logprobs", "advantages", "ref_logprobs") if name in loss.requires}

    # --- ops ---------------------------------------------------------------------------------

    def log_probs(
        self, shard: Mapping[str, torch.Tensor], reference: bool, micro_batch_rows: int, max_tokens_per_microbatch: int | None = None
    ) -> torch.Tensor:
        """[rows, L] logprob of each token given the ones before it (0 on padding and first
        tokens), in passes of at most ``micro_batch_rows`` rows and ``max_tokens_per_microbatch``
        padded tokens."""
        datums, columns = row_datums(shard, self.pad_id)
        values: list[torch.Tensor] = []
        passes = aligned_passes(datums, max_tokens=max_tokens_per_microbatch, max_rows=micro_batch_rows, pad_id=self.pad_id)
        with self._scoring_model(reference) as model, torch.no_grad():
            for one in passes:
                logprobs, _ = self.chunk_logprobs(model, one.datums, collate(one.datums, self.pad_id, self.device))
                if not one.idle:
                    values.extend(logprobs.detach().to("cpu"))
        rows, length = shard["input_ids"].shape  # [B, L], as `check_batch` made sure
        return scatter_back(values, columns, (rows, length))

    def update(self, shard: Mapping[str, torch.Tensor], options: ActorOptions) -> dict[str, float]:
        """PPO epochs x mini-batches of optimizer steps; returns metrics reduced over ranks."""
        loss = self.loss(options)
        datums, _ = row_datums(shard, self.pad_id)
        rows = len(datums)
        if options.mini_batches > rows:
            raise BatchError(f"mini_batches={options.mini_batches} is more than the {rows} rows each rank holds")
        bounds = [rows * part // options.mini_batches for part in range(options.mini_batches + 1)]
        metrics = MetricSum(ADDITIVE_METRICS, additive_reduction(loss))
        steps: list[dict[str, float]] = []
        passes_run = 0
        self.model.train(False)
        for _ in range(options.ppo_epochs):
            for first, last in zip(bounds, bounds[1:]):
                mini = datums[first:last]
                totals = self._all_ranks_totals(step_totals(mini))
                passes = aligned_passes(
                    mini, max_tokens=options.max_tokens_per_microbatch, max_rows=options.micro_batch_rows, pad_id=self.pad_id
                )
                passes_run += len(passes)
                for one in passes:
                    batch = collate(one.datums, self.pad_id, self.device)
                    logprobs, entropy = self.chunk_logprobs(self.model, one.datums, batch, loss.needs_entropy, backward=True)
                    result = loss.loss(policy_loss_inputs(batch, logprobs, entropy, totals))
                    (result.loss * self.world_size).backward()
                    if one.idle:
                        continue
                    metrics.add({"loss": float(result.loss.detach()), **result.metrics}, float(batch.loss_mask.sum()))
                step = self.optimizer.step(options.optimizer)
                steps.append(
                    {"grad_norm": step.grad_norm, "skipped": float(step.skipped), "clipped": float(step.clipped), "lr": step.learning_rate}
                )
        return {**self._reduced(metrics, steps, options), "actor/passes": float(passes_run)}

    def chunk_logprobs(
        self, model: torch.nn.Module, chunk: list[CheckedDatum], batch: PaddedBatch, with_entropy: bool = False, backward: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`shared_prefix.chunk_logprobs` on this rank's chunk of a pass, sharing prefixes
        only when every rank's chunk does: a shared pass runs the model twice (prefix, then
        suffixes) where a plain one runs it once, and the FSDP all-gathers inside each
        forward meet only if every rank runs as many forwards as the others. A pass that
        back-propagates checkpoints its layers with ``ModelOptions.gradient_checkpointing``
        and then shares no prefix on any rank (the options are every rank's)."""
        if backward and self.options.gradient_checkpointing:
            with training_pass(model, True):
                return chunk_logprobs(model, chunk, batch, self.pad_id, with_entropy, share=False)
        return chunk_logprobs(model, chunk, batch, self.pad_id, with_entropy, share=self.all_ranks_share(chunk))

    def all_ranks_share(self, chunk: list[CheckedDatum]) -> bool:
        """Whether prefix sharing pays off on every rank's chunk of this pass (one
        all-reduce; a lone plain module decides alone)."""
        mine = plan_prefix_sharing([datum.input_tokens for datum in chunk]) is not None
        if self.world_size == 1:
            return mine
        flag = torch.tensor([int(mine)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag[0])

    def _all_ranks_totals(self, local: StepTotals) -> StepTotals:
        """A mini-batch's totals over every rank's share of it."""
        sums = torch.tensor([local.tokens, local.sequences], dtype=torch.float64)
        dist.all_reduce(sums)
        columns = torch.tensor([local.columns], dtype=torch.int64)
        dist.all_reduce(columns, op=dist.ReduceOp.MAX)
        return StepTotals(tokens=float(sums[0]), sequences=float(sums[1]), columns=int(columns[0]))

    def _reduced(self, metrics: MetricSum, steps: list[dict[str, float]], options: ActorOptions) -> dict[str, float]:
        """Sums and token-weighted means over every rank's micro-batches (the engine's
        ``name:reduction`` keys), plus the optimizer's numbers."""
        names = sorted(metrics.values)
        values = torch.tensor([metrics.values[name] for name in names], dtype=torch.float64)
        weights = torch.tensor([metrics.weights.get(name, 0.0) for name in names], dtype=torch.float64)
        sums = [i for i, name in enumerate(names) if not (name.endswith(":min") or name.endswith(":max"))]
        reduced = values.clone()
        if sums:
            part = torch.stack([values[sums], weights[sums]])
            dist.all_reduce(part)
            reduced[sums] = part[0]
            weights[sums] = part[1]
        for suffix, op in ((":min", dist.ReduceOp.MIN), (":max", dist.ReduceOp.MAX)):
            picked = [i for i, name in enumerate(names) if name.endswith(suffix)]
            if picked:
                part = values[picked].clone()
                dist.all_reduce(part, op=op)
                reduced[picked] = part
        out: dict[str, float] = {}
        for i, name in enumerate(names):
            out[name] = float(reduced[i] / weights[i]) if name.endswith(":mean") and weights[i] > 0 else float(reduced[i])
        out["actor/optimizer_steps"] = float(len(steps))
        out["actor/grad_norm"] = steps[-1]["grad_norm"]
        out["actor/skipped_steps"] = sum(s["skipped"] for s in steps)
        out["actor/clipped_steps"] = sum(s["clipped"] for s in steps)
        out["actor/lr"] = float(steps[-1]["lr"])  # the rate the optimizer applied: the step's scheduled one
        if self.options.gradient_checkpointing:  # whether the model's layers checkpoint (transformers' flag)
            out["actor/gradient_checkpointing"] = float(is_checkpointing(self.model))
        return out

    @contextlib.contextmanager
    def _scoring_model(self, reference: bool) -> Iterator[torch.nn.Module]:
        """The policy, or the frozen base weights: for LoRA the policy with its adapters
        switched off, otherwise a second sharded model loaded the first time it is asked for."""
        if not reference:
            yield self.model
        elif self.is_lora:
            with adapters_disabled(self.model):
                yield self.model
        else:
            if self._reference is None:
                self._reference = self._load_base()
                self._reference.requires_grad_(False)
            yield self._reference

    # --- weights out -------------------------------------------------------------------------

    def _adapted_on_rank_0(self) -> Any:
        """Rank 0's CPU peft model holding the trained adapters as they are now (every rank
        takes part in gathering them; the others get None)."""
        with torch.no_grad():
            trained = {name: _full(p.detach()) for name, p in self.model.named_parameters() if p.requires_grad}
            if self._adapted is None:
                return None
            own = dict(self._adapted.get_base_model().named_parameters())
            for name, tensor in trained.items():
                own[name].copy_(tensor)
        return self._adapted

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The policy as a plain HF model names its parameters, whole, on rank 0 (every rank
        takes part; the others get an empty dict), in `compute_dtype` (with mixed precision
        the masters rounded to bfloat16: what a sampler runs). For LoRA the adapters are
        merged into the base, as `Engine.export_hf` writes them."""
        if self.is_lora:
            adapted = self._adapted_on_rank_0()
            if adapted is None:
                return {}
            return {name: p.detach() for name, p in merged_copy(adapted).named_parameters()}
        with torch.no_grad():
            weights = {name: _full(p.detach()).to(device="cpu", dtype=self.compute_dtype) for name, p in self.model.named_parameters()}
        return weights if dist.get_rank() == 0 else {}

    def export_hf(self, path: Path) -> None:
        """Write the policy as `Engine.export_hf` does: a plain HF directory (weights in
        `compute_dtype`, tokenizer, chat template), for LoRA with the adapters merged in and
        the adapter itself, in PEFT layout, in ``path / ADAPTER_DIR``. Every rank takes
        part; rank 0 writes."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.is_lora:
            adapted = self._adapted_on_rank_0()
            if adapted is not None:
                path.mkdir(parents=True, exist_ok=True)
                with quiet_progress():
                    merged = merged_copy(adapted)
                    save_adapter(adapted, path / ADAPTER_DIR)
                    save_hf_directory(path, merged, self.tokenizer)
            return
        # A model's state dict holds tensors only (torch types it as any state dict's values).
        full = cast(
            dict[str, torch.Tensor], get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        )
        full = {name: tensor.to(self.compute_dtype) if tensor.is_floating_point() else tensor for name, tensor in full.items()}
        if dist.get_rank() == 0:
            save_hf_directory(path, self.model, self.tokenizer, state_dict=full)

    # --- checkpoints -------------------------------------------------------------------------

    def _sharded_state(self) -> dict[str, Any]:
        """This rank's shards of what trains (every weight, or only the LoRA adapters: the
        frozen base is loaded again by ``init_model``) and of its optimizer state."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model_state, optimizer_state = get_state_dict(
            self.model, self.optimizer.optimizer, options=StateDictOptions(ignore_frozen_params=True)
        )
        trained = {name for name, p in self.model.named_parameters(remove_duplicate=False) if p.requires_grad}
        return {"model": {name: value for name, value in model_state.items() if name in trained}, "optimizer": optimizer_state}

    def save(self, path: Path) -> None:
        """Sharded state of what trains (every weight, or the LoRA adapters) and its
        optimizer with torch.distributed.checkpoint, the policy exported in
        ``path / HF_EXPORT_DIR`` (`export_hf`), and last the step count and the model and
        LoRA settings, which `load` requires."""
        import torch.distributed.checkpoint as dcp

        dcp.save(self._sharded_state(), checkpoint_id=str(path))
        self.export_hf(path / HF_EXPORT_DIR)
        if dist.get_rank() == 0:
            record = {"steps": self.optimizer.steps, "model": self.options.model, "lora": self.options.lora.to_json()}
            (path / _STEP_FILE).write_text(json.dumps(record))
        dist.barrier()

    def load(self, path: Path) -> None:
        """Restore what `save` wrote (same model and LoRA settings, any matching world size)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        record_path = path / _STEP_FILE
        if not record_path.is_file():
            raise BatchError(f"{str(path)!r} is not a worker checkpoint: {_STEP_FILE} is missing")
        record = json.loads(record_path.read_text())
        if record.get("model") != self.options.model:
            raise BatchError(
                f"checkpoint {str(path)!r} was saved from model {record.get('model')!r}; the workers run {self.options.model!r}"
            )
        saved_lora = record.get("lora", LoraSettings().to_json())
        if saved_lora != self.options.lora.to_json():
            raise BatchError(
                f"checkpoint {str(path)!r} was saved with LoRA settings {saved_lora}; the workers run {self.options.lora.to_json()} "
                f"(init_model with the checkpoint's settings to load it)"
            )
        self.optimizer.zero_grad()
        state = self._sharded_state()
        dcp.load(state, checkpoint_id=str(path))
        # Not strict: the frozen base stays the model's own (DCP has checked that every trained tensor was saved).
        set_state_dict(
            self.model,
            self.optimizer.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=StateDictOptions(strict=False),
        )
        self.optimizer.steps = int(record["steps"])
