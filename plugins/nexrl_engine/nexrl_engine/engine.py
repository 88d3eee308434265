"""The single-process compute engine: one model, its tokenizer, sampling and training.

It is the one place where torch runs for NexRL's self-hosted paths: the local
Tinker/Weaver-compatible services call it per request, and the FSDP workers wrap the
same pieces. Its surface is Tinker's, so those services stay thin:

* `Engine.sample` ~ ``SamplingClient.sample`` (raw-model logprobs, stop rules, seeds);
* `Engine.forward` / `Engine.forward_backward` ~ ``TrainingClient.forward[_backward]``
  (losses by registry name, Tinker sum semantics, gradients accumulate);
* `Engine.optim_step` ~ ``optim_step(AdamParams)`` (an `AdamWSettings`);
* `Engine.save_state` / `Engine.load_state` / `Engine.export_hf` for checkpoints and
  for handing merged weights to a sampler.

Public methods hold a lock, so a threaded server may share one engine safely (calls
run one at a time). Model loading holds a process-wide lock, so several threads may
construct engines at once.
"""

from __future__ import annotations

import copy
import json
import random
import threading
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from nexrl_core.config.adamw import AdamWSettings
from nexrl_core.training.model_export import ADAPTER_DIR
from nexrl_engine import checkpoint as ckpt
from nexrl_engine.checkpointing import enable_checkpointing, training_pass
from nexrl_engine.config import EngineConfig
from nexrl_engine.loading import (
    SHIPPED_MODELS,
    load_model,
    load_tokenizer,
    quiet_progress,
    resolve_model_dir,
    save_hf_directory,
    torch_dtype,
)
from nexrl_engine.lora import apply_training_mode, load_in_place, merged_copy, save_adapter
from nexrl_engine.loss_fns import (
    ADDITIVE_METRICS,
    CheckedDatum,
    LossFn,
    PaddedBatch,
    additive_reduction,
    build_loss_fn,
    check_datums,
    collate,
    policy_loss_inputs,
    split_microbatches,
    step_totals,
)
from nexrl_engine.mixed_precision import MASTER_DTYPE, MasterWeights
from nexrl_engine.optim import AdamW
from nexrl_engine.sampling import StopRule, make_stop_rule, sample_batch
from nexrl_engine.shared_prefix import chunk_logprobs
from nexrl_engine.types import (
    Datum,
    DatumOutput,
    ForwardResult,
    LogprobRequest,
    OptimStepResult,
    PromptSamples,
    SamplingParams,
)

__all__ = ["Engine", "MetricSum", "adam_settings"]

_DEFAULT_MAX_POSITIONS = 4096
_MAX_RECYCLED_COPIES = 8
"""Most `export_sampler` models an engine tracks for reuse (a service keeps a few
sampler engines alive; the rest are reused)."""

_CONSTRUCTION_LOCK = threading.Lock()
"""Engines load their model one at a time per process: transformers' ``from_pretrained``
(and peft's wrapping) swap process-global state while they run (empty-weight init on
the meta device, tied-weight handling), and two loads on different threads corrupt
each other ("Cannot copy out of meta tensor", a missing ``lm_head.weight``). Only
loading is serialised; built engines run concurrently."""


def _token_list(value: Any, what: str) -> list[int]:
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{what} must be a list of token ids, got {type(value).__name__}")
    try:
        tokens = [int(token) for token in value]
    except (TypeError, ValueError):
        raise ValueError(f"{what} must contain only integer token ids") from None
    if any(isinstance(token, bool) for token in value):
        raise ValueError(f"{what} must contain integer token ids, not booleans")
    return tokens


def adam_settings(adam_params: AdamWSettings | Mapping[str, Any] | None = None, **overrides: float) -> AdamWSettings:
    """`optim_step`'s arguments as one `AdamWSettings`: a record or a dict of its fields
    (None: the defaults), with keyword overrides on top.

    :raises ValueError: naming unknown fields and listing the valid ones.
    """
    if adam_params is None:
        adam_params = AdamWSettings()
    elif isinstance(adam_params, Mapping):
        adam_params = _adam_from(dict(adam_params))
    if overrides:
        adam_params = _adam_from({**attrs.asdict(adam_params), **overrides})
    return adam_params


def _adam_from(values: dict[str, Any]) -> AdamWSettings:
    valid = [field.name for field in attrs.fields(AdamWSettings)]
    unknown = sorted(set(values) - set(valid))
    if unknown:
        raise ValueError(f"unknown AdamW fields {unknown}; valid: {', '.join(valid)}")
    return AdamWSettings(**values)


class MetricSum:
    """Combines the metrics of micro-batches into Tinker ``name:reduction`` keys.

    ``additive`` metrics (the loss and its entropy term) are each micro-batch's share of
    the step's value (see `StepTotals`), so they add up; they are reported as
    ``name:sum`` under a summed aggregation and ``name:mean`` under a mean, so that a
    client combining several requests (Tinker's SDK splits large ones) reduces them as
    they were computed. Other metrics are token-weighted means, or ``/min`` and ``/max``.
    """

    def __init__(self, additive: frozenset[str], additive_reduction: str = "sum") -> None:
        self.additive = {name: f"{name}:{additive_reduction}" for name in additive}
        self.values: dict[str, float] = {}
        self.weights: dict[str, float] = {}

    def add(self, metrics: Mapping[str, float], weight: float) -> None:
        for key, value in metrics.items():
            value = float(value)
            if key in self.additive:
                name = self.additive[key]
                self.values[name] = self.values.get(name, 0.0) + value
            elif key.endswith("/min") or key.endswith("/max"):
                name = f"{key}:{key[-3:]}"
                pick = min if key.endswith("/min") else max
                self.values[name] = pick(self.values.get(name, value), value)
            else:
                name = f"{key}:mean"
                # Token-weighted across micro-batches; a chunk with no weighted token counts once.
                w = weight if weight > 0 else 1e-12
                self.values[name] = self.values.get(name, 0.0) + value * w
                self.weights[name] = self.weights.get(name, 0.0) + w

    def result(self) -> dict[str, float]:
        out = {}
        for name, value in self.values.items():
            out[name] = value / self.weights[name] if name in self.weights else value
        return out


class Engine:
    """One causal LM (full fine-tuning or LoRA) with sampling, losses, AdamW and checkpoints.

    Build it with an `EngineConfig` or the same fields as keywords:
    ``Engine(model="nexrl-tiny")``, ``Engine(EngineConfig(model=path, lora=LoraSettings(rank=8)))``.
    With ``mixed_precision`` the optimizer and checkpoints work on fp32 masters and the
    model computes in bfloat16 (`nexrl_engine.mixed_precision`).
    """

    def __init__(self, config: EngineConfig | None = None, **fields: Any) -> None:
        if config is None:
            config = EngineConfig(**fields)
        elif fields:
            config = attrs.evolve(config, **fields)
        model_dir = resolve_model_dir(config.model)
        with _CONSTRUCTION_LOCK:
            tokenizer = load_tokenizer(model_dir)
            # Mixed precision loads fp32: the checkpoint's own values become the masters.
            loaded = MASTER_DTYPE if config.mixed_precision else torch_dtype(config.dtype)
            base = load_model(model_dir, loaded, device="cpu")
            model, peft = apply_training_mode(base, config.lora, config.seed)
        self._setup(config, model_dir, tokenizer, model, peft)

    def _setup(self, config: EngineConfig, model_dir: Path, tokenizer: Any, model: Any, peft: Any) -> None:
        self.config = config
        self._lock = threading.RLock()
        try:
            self.device = torch.device(config.device)
        except RuntimeError as exc:
            raise ValueError(f"invalid device {config.device!r}: {exc}") from None
        self.model_dir = model_dir
        self.base_model_id = config.model if config.model in SHIPPED_MODELS else str(self.model_dir)
        """How checkpoints name the base model: the shipped name, or the resolved path."""
        self.tokenizer = tokenizer
        self.model, self._peft = model, peft
        self._master = MasterWeights(model, self.device) if config.mixed_precision else None
        """fp32 masters of the trained weights with ``mixed_precision`` (the model is then
        their bfloat16 compute copy); None otherwise."""
        self.model.to(self.device)
        self.model.eval()
        if config.gradient_checkpointing:
            enable_checkpointing(self.model)
        self._trainable = (
            self._master.named_parameters()
            if self._master is not None
            else [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        )
        """What the optimizer steps and checkpoints hold: the masters, or the model's own."""
        self._optimizer: AdamW | None = None
        self._loss_cache: dict[str, LossFn] = {}
        self._seed_stream = random.Random(config.seed)
        self._copies: list[tuple[weakref.ref[Engine], torch.nn.Module]] = []
        """Models handed out by `export_sampler`, reusable once their engine is gone."""

        model_config = self.model.config
        self.vocab_size: int = int(self.model.get_input_embeddings().num_embeddings)
        self.max_positions: int = int(getattr(model_config, "max_position_embeddings", 0) or _DEFAULT_MAX_POSITIONS)
        self.eos_token_ids: tuple[int, ...] = self._eos_ids()
        pad = self.tokenizer.pad_token_id
        self.pad_token_id: int = int(pad if pad is not None else (self.eos_token_ids[0] if self.eos_token_ids else 0))

    def _eos_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        generation = getattr(self.model, "generation_config", None)
        eos = getattr(generation, "eos_token_id", None) if generation is not None else None
        for value in eos if isinstance(eos, (list, tuple)) else [eos]:
            if value is not None and int(value) not in ids:
                ids.append(int(value))
        if self.tokenizer.eos_token_id is not None and int(self.tokenizer.eos_token_id) not in ids:
            ids.append(int(self.tokenizer.eos_token_id))
        return tuple(ids)

    # --- introspection ----------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Optimizer steps taken (restored by `load_state` with optimizer)."""
        return self._optimizer.steps if self._optimizer is not None else 0

    @property
    def is_lora(self) -> bool:
        return self._peft is not None

    def trainable_parameter_names(self) -> list[str]:
        return [name for name, _ in self._trainable]

    def trained_dtype(self) -> str:
        """The dtype the trained weights are held in (``float32``, ``bfloat16``; the masters'
        with mixed precision), read from the parameters themselves rather than the config
        that asked for it."""
        return str(self._trainable[0][1].dtype).removeprefix("torch.")

    def compute_dtype(self) -> str:
        """The dtype the model computes and samples in, read from its parameters: the
        trained dtype, or bfloat16 over fp32 masters with mixed precision."""
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    def trained_parameters(self) -> dict[str, torch.Tensor]:
        """The trained weights by name as the optimizer steps them and checkpoints hold
        them (the fp32 masters with mixed precision); the engine's own tensors."""
        return dict(self._trainable)

    def num_parameters(self, trainable_only: bool = False) -> int:
        params = [p for _, p in self._trainable] if trainable_only else list(self.model.parameters())
        return sum(p.numel() for p in params)

    # --- sampling ---------------------------------------------------------------------------

    def _check_prompt(self, prompt: Any, index: int) -> list[int]:
        tokens = _token_list(prompt, f"prompt {index}")
        if not tokens:
            raise ValueError(f"prompt {index} is empty; a prompt needs at least one token")
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt {index} has token ids {sorted(set(bad))[:5]} outside the vocabulary [0, {self.vocab_size})")
        if len(tokens) >= self.max_positions:
            raise ValueError(
                f"prompt {index} has {len(tokens)} tokens; the model's context is {self.max_positions}, leaving no room for a new token"
            )
        return tokens

    def sample(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Mapping[str, Any] | Sequence[SamplingParams | Mapping[str, Any]] | None = None,
        *,
        num_samples: int | Sequence[int] = 1,
        include_prompt_logprobs: bool = False,
        seeds: Sequence[int | None] | None = None,
        logprobs: LogprobRequest | Sequence[LogprobRequest | None] | None = None,
    ) -> list[PromptSamples]:
        """Sample ``num_samples`` continuations of each prompt (token id lists); a list
        gives each prompt its own count.

        Returns one `PromptSamples` per prompt. See `SamplingParams` for temperature,
        top-k/top-p, stop and seed semantics. Logprobs are those of the raw model
        distribution and match a teacher-forced pass over prompt + tokens.

        ``seeds``, parallel to ``prompts``, gives prompts their own seeds: prompt i with
        seed s draws the same random numbers as ``sample([prompt_i], params with
        seed=s)``, so it gets the same tokens, with logprobs equal up to float rounding
        (~1e-5; see `sample_batch`). Many single-prompt requests can thus share one batch
        without changing what they sample. A None entry (or no ``seeds``) falls back to
        ``params.seed`` (or a fresh seed), indexed by the prompt's position in this call.

        ``params`` may also be a list with one entry per prompt: requests that sample
        differently then share one decode loop (a service batches its concurrent
        requests so). Each prompt is then seeded as if alone: by its ``seeds`` entry,
        else its own ``params.seed`` (else a fresh seed), so it gets what ``sample([prompt],
        its params)`` gets.

        ``logprobs`` asks for more logprobs from the same passes (`LogprobRequest`: top-k
        at prompt and sampled positions, chosen ids at chosen prompt positions), for every
        prompt or one per prompt; all are of the raw model distribution, like every
        other logprob here.
        """
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
            raise ValueError("prompts must be a non-empty list of token id lists")
        chosen: SamplingParams | list[SamplingParams]
        if isinstance(params, Sequence) and not isinstance(params, (str, bytes)):
            if len(params) != len(prompts):
                raise ValueError(f"params has {len(params)} entries for {len(prompts)} prompts; give one, or one per prompt")
            chosen = [self._sampling_params(own) for own in params]
        else:
            chosen = self._sampling_params(params)
        self._check_num_samples(num_samples, len(prompts))
        checked = [self._check_prompt(prompt, index) for index, prompt in enumerate(prompts)]
        prompt_seeds = self._check_seeds(seeds, len(checked))
        requests = self._check_logprob_requests(logprobs, checked)
        with self._lock:
            if isinstance(chosen, list):
                rule: StopRule | list[StopRule] = [make_stop_rule(own.stop, self.eos_token_ids, self.vocab_size) for own in chosen]
                given = prompt_seeds or [None] * len(chosen)
                prompt_seeds = [seed if seed is not None else own.seed for seed, own in zip(given, chosen)]
                base_seed = self._seed_stream.getrandbits(63)
            else:
                rule = make_stop_rule(chosen.stop, self.eos_token_ids, self.vocab_size)
                base_seed = chosen.seed if chosen.seed is not None else self._seed_stream.getrandbits(63)
            return sample_batch(
                self.model,
                checked,
                chosen,
                num_samples=num_samples,
                stop_rule=rule,
                pad_id=self.pad_token_id,
                max_positions=self.max_positions,
                decode=self._decode_raw,
                base_seed=base_seed,
                prompt_seeds=prompt_seeds,
                include_prompt_logprobs=include_prompt_logprobs,
                logprobs=requests,
            )

    def _check_logprob_requests(
        self, logprobs: LogprobRequest | Sequence[LogprobRequest | None] | None, prompts: list[list[int]]
    ) -> list[LogprobRequest]:
        """One `LogprobRequest` per prompt, each checked against its prompt and the vocabulary."""
        if logprobs is None or isinstance(logprobs, LogprobRequest):
            requests = [logprobs or LogprobRequest()] * len(prompts)
        elif isinstance(logprobs, (str, bytes)) or not isinstance(logprobs, Sequence) or len(logprobs) != len(prompts):
            raise ValueError(f"logprobs must be one LogprobRequest or one per prompt ({len(prompts)}), got {logprobs!r}")
        else:
            requests = [request or LogprobRequest() for request in logprobs]
        for index, (request, prompt) in enumerate(zip(requests, prompts)):
            if not isinstance(request, LogprobRequest):
                raise ValueError(f"logprobs[{index}] must be a LogprobRequest or None, got {type(request).__name__}")
            for name in ("topk_prompt_logprobs", "topk_sample_logprobs"):
                k = getattr(request, name)
                if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= self.vocab_size:
                    raise ValueError(
                        f"logprobs[{index}].{name} must be an integer from 0 to the vocabulary size {self.vocab_size}, got {k!r}"
                    )
            targets = request.target_prompt_logprobs
            if targets is None:
                continue
            if len(targets.positions) != len(targets.token_ids):
                raise ValueError(
                    f"logprobs[{index}].target_prompt_logprobs has {len(targets.positions)} positions for {len(targets.token_ids)} token ids"
                )
            if any(not 1 <= p < len(prompt) for p in targets.positions):
                raise ValueError(
                    f"logprobs[{index}].target_prompt_logprobs positions must be from 1 to len(prompt) - 1 = {len(prompt) - 1}"
                )
            if any(not 0 <= t < self.vocab_size for t in targets.token_ids):
                raise ValueError(f"logprobs[{index}].target_prompt_logprobs token ids must be in the vocabulary [0, {self.vocab_size})")
        return requests

    @staticmethod
    def _sampling_params(params: SamplingParams | Mapping[str, Any] | None) -> SamplingParams:
        if params is None:
            return SamplingParams()
        return SamplingParams(**params) if isinstance(params, Mapping) else params

    @staticmethod
    def _check_num_samples(num_samples: int | Sequence[int], n_prompts: int) -> None:
        counts = [num_samples] if isinstance(num_samples, int) else num_samples
        if isinstance(counts, (str, bytes)) or not isinstance(counts, Sequence):
            raise ValueError(f"num_samples must be an integer >= 1 or one per prompt, got {num_samples!r}")
        if not isinstance(num_samples, int) and len(counts) != n_prompts:
            raise ValueError(f"num_samples has {len(counts)} counts for {n_prompts} prompts; give one per prompt")
        for count in counts:
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ValueError(f"num_samples must be integers >= 1, got {num_samples!r}")

    @staticmethod
    def _check_seeds(seeds: Sequence[int | None] | None, n_prompts: int) -> list[int | None] | None:
        if seeds is None:
            return None
        if isinstance(seeds, (str, bytes)) or not isinstance(seeds, Sequence):
            raise ValueError(f"seeds must be a list of integers or None, one per prompt, got {type(seeds).__name__}")
        if len(seeds) != n_prompts:
            raise ValueError(f"seeds has {len(seeds)} entries for {n_prompts} prompts; give one per prompt")
        for index, seed in enumerate(seeds):
            if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
                raise ValueError(f"seeds[{index}] must be an integer or None, got {seed!r}")
        return list(seeds)

    def _decode_raw(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def compute_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float | None]]:
        """Teacher-forced logprobs of whole sequences: None at position 0, then
        log p(seq[t] | seq[:t]). Tinker's ``compute_logprobs``."""
        if isinstance(sequences, (str, bytes)) or not isinstance(sequences, Sequence) or len(sequences) == 0:
            raise ValueError("sequences must be a non-empty list of token id lists")
        checked = []
        for index, sequence in enumerate(sequences):
            tokens = self._check_prompt(sequence, index)
            checked.append(CheckedDatum(tokens[:-1] or tokens[:1], {"target_tokens": tokens[1:] or tokens[:1]}))
        results: list[list[float | None]] = []
        with self._lock, torch.no_grad():
            for group in split_microbatches(checked, self.config.max_tokens_per_microbatch):
                chunk = [checked[i] for i in group]
                logprobs, _ = self._target_logprobs(chunk, collate(chunk, self.pad_token_id, self.device), False)
                for slot, index in enumerate(group):
                    n = len(sequences[index]) - 1
                    results.append([None] + logprobs[slot, :n].tolist())
        return results

    # --- training -------------------------------------------------------------------------------

    def _target_logprobs(
        self, chunk: Sequence[CheckedDatum], batch: PaddedBatch, with_entropy: bool, backward: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, T] target logprobs (and entropies) of a collated chunk, sharing common
        prefixes when that saves work (``EngineConfig.share_prefixes``). A pass that
        back-propagates checkpoints its layers when ``EngineConfig.gradient_checkpointing``
        (and then shares no prefix: a checkpointed layer would write the prefix's cache
        again when the backward pass recomputes it)."""
        checkpointing = backward and self.config.gradient_checkpointing
        share = self.config.share_prefixes and not checkpointing
        with training_pass(self.model, checkpointing):
            return chunk_logprobs(self.model, chunk, batch, self.pad_token_id, with_entropy, share)

    def _loss_fn(self, name: str, loss_fn_config: Mapping[str, Any] | None) -> LossFn:
        key = json.dumps([name, dict(loss_fn_config or {})], sort_keys=True, default=str)
        fn = self._loss_cache.get(key)
        if fn is None:
            fn = build_loss_fn(name, loss_fn_config)
            self._loss_cache[key] = fn
        return fn

    def forward(self, datums: Sequence[Datum], loss_fn: str, loss_fn_config: Mapping[str, Any] | None = None) -> ForwardResult:
        """Loss and per-token target logprobs without touching gradients."""
        return self._run(datums, loss_fn, loss_fn_config, backward=False)

    def forward_backward(self, datums: Sequence[Datum], loss_fn: str, loss_fn_config: Mapping[str, Any] | None = None) -> ForwardResult:
        """Like `forward`, then back-propagate; gradients add up until `optim_step`."""
        return self._run(datums, loss_fn, loss_fn_config, backward=True)

    def _run(self, datums: Sequence[Datum], loss_name: str, loss_fn_config: Mapping[str, Any] | None, backward: bool) -> ForwardResult:
        fn = self._loss_fn(loss_name, loss_fn_config)
        checked = check_datums(datums, fn, self.vocab_size)
        metrics = MetricSum(ADDITIVE_METRICS, additive_reduction(fn))
        totals = step_totals(checked)
        outputs: list[DatumOutput | None] = [None] * len(checked)
        num_tokens = 0.0
        with self._lock, torch.set_grad_enabled(backward):
            for group in split_microbatches(checked, self.config.max_tokens_per_microbatch):
                chunk = [checked[i] for i in group]
                batch = collate(chunk, self.pad_token_id, self.device)
                logprobs, entropy = self._target_logprobs(chunk, batch, fn.needs_entropy, backward)
                result = fn.loss(policy_loss_inputs(batch, logprobs, entropy, totals))
                if backward:
                    result.loss.backward()
                    if self._master is not None:
                        self._master.collect_grads()
                weight = float(batch.loss_mask.abs().sum())
                num_tokens += weight
                metrics.add({"loss": float(result.loss.detach()), **result.metrics}, weight)
                detached = logprobs.detach().to("cpu")
                for slot, index in enumerate(group):
                    outputs[index] = DatumOutput(detached[slot, : batch.lengths[slot]].tolist())
        combined = metrics.result()
        combined["num_tokens:sum"] = num_tokens
        combined["num_sequences:sum"] = float(len(checked))
        return ForwardResult(outputs=[o for o in outputs if o is not None], metrics=combined, loss_fn=loss_name)

    def _optimizer_or_new(self) -> AdamW:
        if self._optimizer is None:
            self._optimizer = AdamW(self._trainable)
        return self._optimizer

    def optim_step(self, adam_params: AdamWSettings | Mapping[str, Any] | None = None, **overrides: float) -> OptimStepResult:
        """One AdamW step on the accumulated gradients, then zero them.

        ``adam_params`` (an `AdamWSettings` or a dict of its fields) and keyword overrides,
        e.g. ``optim_step(learning_rate=1e-3, grad_clip_norm=1.0)``; unspecified fields
        take `AdamWSettings`' defaults. Hyper-parameters apply to this step only.
        """
        settings = adam_settings(adam_params, **overrides)
        with self._lock:
            result = self._optimizer_or_new().step(settings)
            if self._master is not None and not result.skipped:
                self._master.publish()
            return result

    def zero_grad(self) -> None:
        """Drop accumulated gradients without stepping."""
        with self._lock:
            if self._master is not None:
                self._master.zero_grad()
                return
            for _, parameter in self._trainable:
                parameter.grad = None

    # --- checkpoints ------------------------------------------------------------------------

    def save_state(self, path: str | Path, include_optimizer: bool = True) -> Path:
        """Save the trainable weights (and by default the optimizer state) to a directory:
        with mixed precision the fp32 masters and their fp32 moments, so a resumed run
        continues from exactly where this one was."""
        with self._lock:
            optimizer_state = None
            if include_optimizer:
                optimizer_state = self._optimizer.state_tensors() if self._optimizer is not None else {}
            manifest = ckpt.CheckpointManifest(
                base_model=self.base_model_id,
                dtype=self.trained_dtype(),
                lora=self.config.lora.to_json() if self.is_lora else None,
                step=self.step,
                has_optimizer=include_optimizer,
                parameters=self.trainable_parameter_names(),
            )
            return ckpt.write_checkpoint(path, manifest, self.trained_parameters(), optimizer_state)

    def load_state(self, path: str | Path, load_optimizer: bool = True) -> ckpt.CheckpointManifest:
        """Load weights saved by `save_state` into this engine; with ``load_optimizer``
        also the AdamW moments and step count, otherwise the optimizer starts fresh.

        The checkpoint must come from the same base model and LoRA settings; its weights
        are converted to the dtype this engine trains in (fp32 masters, which the
        mixed-precision model then computes with rounded to bfloat16). Accumulated
        gradients are dropped.
        """
        own = self.trained_parameters()
        loaded = ckpt.read_for_loading(
            path,
            base_model=self.base_model_id,
            lora=self.config.lora.to_json() if self.is_lora else None,
            shapes={name: tuple(parameter.shape) for name, parameter in own.items()},
            load_optimizer=load_optimizer,
        )
        manifest, weights, optimizer_state = loaded.manifest, loaded.weights, loaded.optimizer_state
        with self._lock, torch.no_grad():
            for name, tensor in weights.items():
                own[name].copy_(tensor.to(device=own[name].device, dtype=own[name].dtype))
            if self._master is not None:
                self._master.publish()
            self._optimizer = AdamW(self._trainable)
            if optimizer_state is not None:
                self._optimizer.load_state_tensors(optimizer_state, manifest.step)
        return manifest

    def export_hf(self, path: str | Path) -> Path:
        """Write merged weights (LoRA folded into the base), the tokenizer and its chat
        template as an HF directory, loadable by ``Engine(model=path)`` or any
        transformers code. For LoRA the adapter itself is also written, in PEFT layout,
        to ``path / ADAPTER_DIR`` (``PeftModel.from_pretrained(base, that)``). The weights
        are the ones the model computes with: ``dtype``, with mixed precision the bfloat16
        weights the masters round to (what sampling used; checkpoints hold the masters)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        with self._lock, quiet_progress():
            if self._peft is None:
                model = self.model
            else:
                model = merged_copy(self._peft)
                save_adapter(self._peft, path / ADAPTER_DIR)
            return save_hf_directory(path, model, self.tokenizer)

    def export_sampler(self, path: str | Path) -> Engine:
        """`export_hf`, returning an engine equal to ``Engine(model=path)`` without
        reading the directory back: a service hands freshly saved sampler weights to
        its sampler this way. The new engine works on its own copy of the weights (the
        one written) and shares the tokenizer; it is for sampling and scoring."""
        with self._lock:
            if self._peft is not None:
                return self._sampler_on(merged_copy(self._peft), path, recycle=False)
            model = self._weights_copy()
        return self._sampler_on(model, path, recycle=True)

    def sampler_with(self, weights: Mapping[str, torch.Tensor], path: str | Path | None = None) -> Engine:
        """Like `export_sampler`, with ``weights`` (every parameter of this engine's
        model, by name: a worker group's pushed policy) in place of this engine's own;
        without ``path`` nothing is written and the engine names this one's model. A
        LoRA policy that adapted the output projection of a tied model arrives with a
        head weight of its own; the copy's head is then untied (`load_in_place`).

        :raises ValueError: naming missing or unexpected parameters, before anything is copied.
        """
        if self._peft is not None:
            raise ValueError("sampler_with needs a full model's engine (the base model's sampler), not a LoRA engine")
        with self._lock:
            if set(weights) == {name for name, _ in self.model.named_parameters()}:
                return self._sampler_on(self._weights_copy(weights), path, recycle=True)
            model = copy.deepcopy(self.model)
        load_in_place(model, weights)
        return self._sampler_on(model, path, recycle=False)

    def _sampler_on(self, model: torch.nn.Module, path: str | Path | None, recycle: bool) -> Engine:
        """Write ``model`` as an HF directory at ``path`` (if given) and wrap it in an
        engine that shares this one's tokenizer, dtype, device and micro-batch budget (a
        service's samplers pack their passes as its training engines do); ``recycle``:
        `_weights_copy` may reuse ``model`` once nobody holds that engine."""
        kept = {name: getattr(self.config, name) for name in ("dtype", "device", "max_tokens_per_microbatch")}
        if path is None:
            config, model_dir = EngineConfig(model=self.config.model, **kept), self.model_dir
        else:
            save_hf_directory(Path(path), model, self.tokenizer)
            config, model_dir = EngineConfig(model=str(path), **kept), resolve_model_dir(str(path))
        clone = Engine.__new__(Engine)
        clone._setup(config, model_dir, self.tokenizer, model, None)
        if recycle:
            with self._lock:
                self._copies.append((weakref.ref(clone), model))
        return clone

    def _weights_copy(self, weights: Mapping[str, torch.Tensor] | None = None) -> torch.nn.Module:
        """A copy of the (full) model holding ``weights`` (every parameter by name; None:
        this engine's own), written into the model of an earlier sampler engine nobody
        holds any more when there is one: a step's sampler copy then costs a memory
        copy, not fresh allocations (which page-fault) and a deepcopy of the module
        tree. Caller holds the lock."""
        sources = dict(self.model.named_parameters()) if weights is None else weights
        for index, (engine, model) in enumerate(self._copies):  # noqa: B007 - ``model`` is used after the break
            if engine() is None:
                del self._copies[index]
                break
        else:
            if len(self._copies) >= _MAX_RECYCLED_COPIES:
                self._copies.pop(0)
            model = copy.deepcopy(self.model)
            if weights is None:
                return model
        with torch.no_grad():
            for name, target in model.named_parameters():
                target.copy_(sources[name])
        return model

    def __repr__(self) -> str:
        mode = f"lora rank {self.config.lora.rank}" if self.is_lora else "full fine-tuning"
        return f"Engine(model={self.base_model_id!r}, dtype={self.config.dtype}, {mode}, step={self.step})"
