"""A training model on its own worker group: `Engine`'s training operations, run by FSDP ranks.

``nexrl serve tinker --workers N`` gives every training model a group of N ranks under
torchrun (`nexrl_fsdp.direct_zmq.launch.LocalWorkerGroup`: the self-hosted backend's
workers and transport). `WorkerGroupEngine` is what the engine pool hands the service
for such a model instead of an `Engine`: the same calls (forward and forward_backward
on Tinker datums with any registered loss, optim_step with every AdamW field, the
training state saved and loaded in the engine's checkpoint format, weights exported for
a sampler or a download), so the protocols, the store and the scheduler do not change.

A sampler of the model's weights is fed from the group: rank 0 pushes the whole policy
as raw frames into a `WeightsInbox` of this process, and the base model's sampling
engine copies them into a sampler engine of its own (`Engine.sampler_with`); no file is
read back. Because checkpoints are the engine's, a group can always be rebuilt from a
model's last saved state (a restarted service does, on the model's first request).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from nexrl_core.config.adamw import AdamWSettings
from nexrl_fsdp import checkpoint as ckpt
from nexrl_fsdp.direct_zmq.datums import datum_tensors
from nexrl_fsdp.direct_zmq.launch import LocalWorkerGroup
from nexrl_fsdp.direct_zmq.weights_inbox import WeightsInbox
from nexrl_fsdp.engine import Engine, adam_settings
from nexrl_fsdp.loss_fns import LossFn, build_loss_fn, check_datums
from nexrl_fsdp.config import TrainingSpec
from nexrl_fsdp.types import Datum, DatumOutput, ForwardResult, OptimStepResult

__all__ = ["GroupSettings", "WorkerGroupEngine"]


@attrs.frozen(kw_only=True)
class GroupSettings:
    """How a service's worker groups are started."""

    ranks: int
    """Ranks (processes) per group."""
    threads_per_rank: int
    """torch threads of each rank (``OMP_NUM_THREADS``)."""
    log_dir: Path
    """Each group's combined output goes to ``<log_dir>/<model id>.log``."""
    connect_timeout_s: float = 300.0
    """How long a new group may take to start and load the model."""
    op_timeout_s: float = 600.0


def _identifier(model_id: str) -> str:
    """A group name the workers' API accepts, from a model id."""
    return "model-" + re.sub(r"[^A-Za-z0-9_.\-]", "-", model_id)[:180]


class WorkerGroupEngine:
    """One training model on its own worker group; calls run one at a time."""

    def __init__(
        self, model_id: str, spec: TrainingSpec, dtype: str, settings: GroupSettings, base_sampler: Callable[[], Engine]
    ) -> None:
        """Start the group and load the model on it.

        ``base_sampler`` gives the base model's sampling engine, whose model takes the
        group's pushed weights for each sampler of this model.

        :raises WorkerGroupError: when the group does not start (its log names why).
        """
        self.model_id = model_id
        self.spec = spec
        self.config = spec.engine_config(dtype)
        self.log_path = settings.log_dir / f"{model_id}.log"
        self._base_sampler = base_sampler
        self._lock = threading.Lock()
        self._losses: dict[str, LossFn] = {}
        self.group = LocalWorkerGroup(
            settings.ranks,
            self.log_path,
            identifier=_identifier(model_id),
            connect_timeout_s=settings.connect_timeout_s,
            op_timeout_s=settings.op_timeout_s,
            extra_env={"OMP_NUM_THREADS": str(settings.threads_per_rank)},
        )
        try:
            info = self.group.transport.init_model(self.config.model, dtype=self.config.dtype, seed=spec.lora_seed, lora=spec.lora)
        except BaseException:
            self.group.stop()
            raise
        self.vocab_size = int(info["vocab_size"])
        self.ranks = settings.ranks

    # --- training -----------------------------------------------------------------------------

    def _loss_fn(self, name: str, loss_fn_config: Mapping[str, Any] | None) -> LossFn:
        key = json.dumps([name, dict(loss_fn_config or {})], sort_keys=True, default=str)
        if key not in self._losses:
            self._losses[key] = build_loss_fn(name, loss_fn_config)
        return self._losses[key]

    def forward(self, datums: Sequence[Datum], loss_fn: str, loss_fn_config: Mapping[str, Any] | None = None) -> ForwardResult:
        """Loss and per-token target logprobs without touching gradients."""
        return self._run(datums, loss_fn, loss_fn_config, backward=False)

    def forward_backward(
        self, datums: Sequence[Datum], loss_fn: str, loss_fn_config: Mapping[str, Any] | None = None
    ) -> ForwardResult:
        """Like `forward`, then back-propagate; gradients add up on the ranks until `optim_step`."""
        return self._run(datums, loss_fn, loss_fn_config, backward=True)

    def _run(self, datums: Sequence[Datum], loss_name: str, loss_fn_config: Mapping[str, Any] | None, backward: bool) -> ForwardResult:
        checked = check_datums(datums, self._loss_fn(loss_name, loss_fn_config), self.vocab_size)
        options = {
            "loss_fn": loss_name,
            "loss_fn_config": dict(loss_fn_config or {}),
            "backward": backward,
            "max_tokens_per_microbatch": self.config.max_tokens_per_microbatch,
        }
        with self._lock:
            reply = self.group.transport.forward(datum_tensors(checked), options)
        values = reply.tensors["logprobs"].tolist()
        outputs, start = [], 0
        for datum in checked:
            end = start + len(datum.input_tokens)
            outputs.append(DatumOutput(values[start:end]))
            start = end
        metrics = {name: float(value) for name, value in reply.header["metrics"].items()}
        return ForwardResult(outputs=outputs, metrics=metrics, loss_fn=loss_name)

    def optim_step(self, adam_params: AdamWSettings | Mapping[str, Any] | None = None, **overrides: float) -> OptimStepResult:
        """One AdamW step on the accumulated gradients, then zero them (as `Engine.optim_step`)."""
        settings = adam_settings(adam_params, **overrides)
        with self._lock:
            result = self.group.transport.optim_step(settings.to_json())
        return OptimStepResult(
            grad_norm=float(result["grad_norm"]),
            learning_rate=float(result["learning_rate"]),
            step=int(result["step"]),
            skipped=bool(result["skipped"]),
            clipped=bool(result["clipped"]),
        )

    # --- state --------------------------------------------------------------------------------

    def save_state(self, path: str | Path, include_optimizer: bool = True) -> Path:
        """The trainable weights (and by default the optimizer state), in the engine's format."""
        with self._lock:
            self.group.transport.save_state(str(path), include_optimizer)
        return Path(path)

    def load_state(self, path: str | Path, load_optimizer: bool = True) -> ckpt.CheckpointManifest:
        """Load a checkpoint `save_state` (or an `Engine`) wrote; ValueError when it does not fit."""
        with self._lock:
            self.group.transport.load_state(str(path), load_optimizer)
        return ckpt.read_manifest(path)

    # --- weights for samplers and downloads -------------------------------------------------------

    def _pushed_sampler(self, path: Path | None) -> Engine:
        base = self._base_sampler()
        with self._lock, WeightsInbox(lambda weights: base.sampler_with(weights, path)) as inbox:
            self.group.transport.push_weights(inbox.endpoint)
        return inbox.loaded()

    def export_sampler(self, path: str | Path) -> Engine:
        """The policy as an HF directory at ``path`` and a sampling engine on it, fed
        from the group (as `Engine.export_sampler`; for LoRA the adapter is written beside)."""
        if self.spec.lora.is_lora:
            self.export_hf(path)
        return self._pushed_sampler(None if self.spec.lora.is_lora else Path(path))

    def sampler(self) -> Engine:
        """A sampling engine on the current policy, fed from the group; nothing is written."""
        return self._pushed_sampler(None)

    def export_hf(self, path: str | Path) -> Path:
        """The policy as an HF directory at ``path``, written by rank 0 as `Engine.export_hf`
        writes it (for LoRA: the adapters merged in and the adapter in PEFT layout beside)."""
        with self._lock:
            return Path(self.group.transport.export_hf(str(path)))

    # --- lifecycle ------------------------------------------------------------------------------

    def rank_pids(self) -> dict[int, int]:
        """Each rank's process id."""
        with self._lock:
            return self.group.rank_pids()

    def stop(self) -> None:
        """End the group (after the call in flight, if any); every rank exits."""
        with self._lock:
            self.group.stop()

    def __repr__(self) -> str:
        return f"WorkerGroupEngine(model={self.config.model!r}, ranks={self.ranks}, log={str(self.log_path)!r})"
