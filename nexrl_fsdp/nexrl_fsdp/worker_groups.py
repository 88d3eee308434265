"""A training model on its own worker group: `Engine`'s training operations, run by FSDP ranks.

``nexrl serve tinker --workers N`` gives every training model a group of N ranks under
torchrun (`nexrl_fsdp.direct_zmq.launch.WorkerGroup`: the self-hosted backend's workers and
transport). `WorkerGroupEngine` is what the engine pool gets for such a model instead of an
`Engine`, through the core's seam (`nexrl_core.training.worker_groups`, which also defines the
settings and restart records; `nexrl_fsdp.group_engines` is this package's side of it): the
same calls (forward and forward_backward on Tinker datums with any registered loss,
optim_step with every AdamW field, the training state saved and loaded in the engine's
checkpoint format, weights exported for a sampler or a download), so the protocols, the
store and the scheduler do not change.

A sampler of the model's weights is fed from the group: rank 0 pushes the whole policy
as raw frames into a `WeightsInbox` of this process, and the base model's sampling
engine copies them into a sampler engine of its own (`Engine.sampler_with`); no file is
read back. Because checkpoints are the engine's, a group can always be rebuilt from a
model's last saved state (a restarted service does, on the model's first request).

A group heals itself. When it is lost (a rank died, or an op ran past its deadline), the
engine stops what is left of it, starts a new one, loads the last restart point (the
last state saved with the optimizer: every ``save_every`` optimizer steps into the
service's autosave folder, or a save or load the client asked for), replays the calls
that changed the model since then (forward_backward and optim_step, kept in memory), and
runs the call in flight again. Nothing the client was answered is lost, and the call in
flight only takes longer. ``max_restarts`` bounds the restarts one call may cause.

A service killed as a whole loses that memory, so a service's group also writes each of
those calls to a journal (`nexrl_fsdp.group_journal`) before answering it, and a
restarted service rebuilds the model with `recover`: the restart point, then the
journal. Saving the whole training state after every optimizer step would do the same
at the cost of writing the weights and both Adam moments each step (0.35 s a step for a
50M model on a 2-core CPU, a third of its step); a journal entry is a step's datums.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs

from nexrl_core.config.adamw import AdamWSettings
from nexrl_core.http.serving import DEFAULT_MAX_TOKENS_PER_MICROBATCH
from nexrl_core.training.worker_groups import GroupHooks, GroupRestart, GroupSettings
from nexrl_engine import checkpoint as ckpt
from nexrl_engine.config import TrainingSpec
from nexrl_engine.engine import Engine, adam_settings
from nexrl_engine.loss_fns import LossFn, build_loss_fn, check_datums
from nexrl_engine.types import Datum, DatumOutput, ForwardResult, OptimStepResult
from nexrl_fsdp.direct_zmq.datums import datum_tensors
from nexrl_fsdp.direct_zmq.launch import WorkerGroup
from nexrl_fsdp.direct_zmq.transport import OpRefused, WorkerGroupError, WorkerGroupLost
from nexrl_fsdp.direct_zmq.weights_inbox import WeightsInbox
from nexrl_fsdp.group_journal import GroupJournal, ReplayCall

__all__ = ["WorkerGroupEngine", "group_identifier"]

log = logging.getLogger("nexrl_fsdp.worker_groups")

T = TypeVar("T")

_LOST_GRACE_S = 5.0
"""After an op fails on a rank, how long to wait for the launcher to end the group (a
peer that died fails the survivors' collectives before torchrun stops them)."""


@attrs.frozen
class _RestartPoint:
    path: Path
    with_optimizer: bool


def group_identifier(model_id: str) -> str:
    """The group's name (a name the workers' API accepts, from a model id): its processes carry it
    on their command lines."""
    return "model-" + re.sub(r"[^A-Za-z0-9_.\-]", "-", model_id)[:180]


class WorkerGroupEngine:
    """One training model on its own worker group; calls run one at a time."""

    def __init__(
        self,
        model_id: str,
        spec: TrainingSpec,
        dtype: str,
        settings: GroupSettings,
        base_sampler: Callable[[], Engine],
        hooks: GroupHooks | None = None,
        *,
        gpus: Sequence[int] = (),
        max_tokens_per_microbatch: int = DEFAULT_MAX_TOKENS_PER_MICROBATCH,
    ) -> None:
        """Start the group and load the model on it.

        ``base_sampler`` gives the base model's sampling engine, whose model takes the
        group's pushed weights for each sampler of this model. ``gpus``, one per rank,
        are the GPUs its ranks see (``CUDA_VISIBLE_DEVICES``; none: every GPU, or the CPU).
        ``max_tokens_per_microbatch`` is the most padded tokens of one forward or
        forward/backward pass on a rank (the service's, as its in-process engines').

        :raises WorkerGroupError: when the group does not start (its log names why).
        """
        self.model_id = model_id
        self.spec = spec
        self.config = spec.engine_config(dtype, max_tokens_per_microbatch=max_tokens_per_microbatch)
        self.settings = settings
        self.hooks = hooks or GroupHooks()
        self.log_path = settings.log_dir / f"{model_id}.log"
        self._base_sampler = base_sampler
        self.gpus = list(gpus)
        self._lock = threading.Lock()
        self._losses: dict[str, LossFn] = {}
        self._restart_point: _RestartPoint | None = None
        self._since_restart_point: list[ReplayCall] = []
        self._steps_since_save = 0
        self._journal = GroupJournal(self.hooks.autosave_dir / "journal") if self.hooks.autosave_dir is not None else None
        self._lost: WorkerGroupLost | None = None
        self.restarts = 0
        """Restarts of this model's group so far."""
        self.group = self._start_group()
        self.ranks = settings.ranks

    def _start_group(self) -> WorkerGroup:
        settings = self.settings
        group = WorkerGroup(
            settings.ranks,
            self.log_path,
            placer=settings.placer,
            cpus_per_rank=float(settings.threads_per_rank),
            identifier=group_identifier(self.model_id),
            heartbeat_s=settings.heartbeat_s,
            dead_after_s=settings.dead_after_s,
            connect_timeout_s=settings.connect_timeout_s,
            op_timeout_s=settings.op_timeout_s,
            extra_env={
                "OMP_NUM_THREADS": str(settings.threads_per_rank),
                **({"CUDA_VISIBLE_DEVICES": ",".join(map(str, self.gpus))} if self.gpus else {}),
            },
        )
        try:
            info = group.transport.init_model(self.config.model, dtype=self.config.dtype, seed=self.spec.lora_seed, lora=self.spec.lora)
        except BaseException:
            group.stop()
            raise
        self.vocab_size = int(info["vocab_size"])
        return group

    # --- training -----------------------------------------------------------------------------

    def _loss_fn(self, name: str, loss_fn_config: Mapping[str, Any] | None) -> LossFn:
        key = json.dumps([name, dict(loss_fn_config or {})], sort_keys=True, default=str)
        if key not in self._losses:
            self._losses[key] = build_loss_fn(name, loss_fn_config)
        return self._losses[key]

    def forward(self, datums: Sequence[Datum], loss_fn: str, loss_fn_config: Mapping[str, Any] | None = None) -> ForwardResult:
        """Loss and per-token target logprobs without touching gradients."""
        return self._run(datums, loss_fn, loss_fn_config, backward=False)

    def forward_backward(self, datums: Sequence[Datum], loss_fn: str, loss_fn_config: Mapping[str, Any] | None = None) -> ForwardResult:
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
        tensors = datum_tensors(checked)
        replay = ReplayCall("forward_backward", tensors, options) if backward else None
        reply = self._call(lambda: self.group.transport.forward(tensors, options), replay)
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
        settings = adam_settings(adam_params, **overrides).to_json()
        result = self._call(lambda: self.group.transport.optim_step(settings), ReplayCall("optim_step", options=settings))
        return OptimStepResult(
            grad_norm=float(result["grad_norm"]),
            learning_rate=float(result["learning_rate"]),
            step=int(result["step"]),
            skipped=bool(result["skipped"]),
            clipped=bool(result["clipped"]),
        )

    # --- state --------------------------------------------------------------------------------

    def save_state(self, path: str | Path, include_optimizer: bool = True) -> Path:
        """The trainable weights (and by default the optimizer state), in the engine's
        format; saved with the optimizer, it becomes the restart point."""
        point = _RestartPoint(Path(path), True) if include_optimizer else None
        self._call(lambda: self.group.transport.save_state(str(path), include_optimizer), restart_point=point)
        return Path(path)

    def load_state(self, path: str | Path, load_optimizer: bool = True) -> ckpt.CheckpointManifest:
        """Load a checkpoint `save_state` (or an `Engine`) wrote; ValueError when it does
        not fit. It becomes the restart point."""
        self._call(
            lambda: self.group.transport.load_state(str(path), load_optimizer), restart_point=_RestartPoint(Path(path), load_optimizer)
        )
        return ckpt.read_manifest(path)

    # --- weights for samplers and downloads -------------------------------------------------------

    def _pushed_sampler(self, path: Path | None) -> Engine:
        base = self._base_sampler()

        def push() -> Engine:
            with WeightsInbox(lambda weights: base.sampler_with(weights, path), key=self.group.key) as inbox:
                self.group.transport.push_weights(inbox.endpoint)
            return inbox.loaded()

        return self._call(push)

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
        return Path(self._call(lambda: self.group.transport.export_hf(str(path))))

    # --- healing ------------------------------------------------------------------------------

    def _call(self, op: Callable[[], T], replay: ReplayCall | None = None, restart_point: _RestartPoint | None = None) -> T:
        """Run ``op`` on the group, one call at a time; a lost group is restarted (up to
        ``max_restarts`` times for this call) and ``op`` run again on the new one. Once
        it succeeds, a call that changed the model is remembered for replay (an optimizer
        step may save the next restart point), or ``restart_point`` becomes the new one."""
        with self._lock:
            restarts = 0
            while True:
                try:
                    if self._lost is not None:
                        self._restart(self._lost)
                    result = op()
                    break
                except WorkerGroupLost as exc:
                    self._lost = exc
                except OpRefused:
                    raise
                except WorkerGroupError as exc:
                    if not self._group_ended():
                        raise
                    self._lost = WorkerGroupLost(f"worker group of {self.model_id!r} ended during a call: {exc}")
                restarts += 1
                if restarts > self.settings.max_restarts:
                    raise WorkerGroupLost(
                        f"the worker group of model {self.model_id!r} was lost {restarts} times in one call "
                        f"(max_restarts {self.settings.max_restarts}); the last time: {self._lost}. Its state is kept: "
                        "the next request starts a new group from the last restart point"
                    )
            if restart_point is not None:
                self._set_restart_point(restart_point)
            if replay is not None:
                if self._journal is not None:
                    self._journal.append(replay)
                self._since_restart_point.append(replay)
                if replay.op == "optim_step":
                    self._steps_since_save += 1
                    if self.hooks.autosave_dir is not None and self._steps_since_save >= self.settings.save_every:
                        self._autosave(self.hooks.autosave_dir)
            return result

    def _group_ended(self) -> bool:
        """Whether the launcher ended the group (waiting a little for it to notice a dead peer)."""
        deadline = time.monotonic() + _LOST_GRACE_S
        while time.monotonic() < deadline:
            if self.group.ended():
                return True
            time.sleep(0.1)
        return self.group.ended()

    def _restart(self, lost: WorkerGroupLost) -> None:
        """Replace the lost group with a new one holding the model as the client last saw it."""
        started = time.monotonic()
        tail = self.group.log_tail(2000)
        log.warning("worker group of %s lost (%s); restarting it. Its last output:\n%s", self.model_id, lost, tail)
        self.group.stop()
        self.group = self._start_group()
        point = self._restart_point
        self._load(point, self._since_restart_point)
        self._lost = None
        self.restarts += 1
        restart = GroupRestart(
            reason=str(lost),
            restored_from=str(point.path) if point is not None else None,
            replayed=len(self._since_restart_point),
            seconds=time.monotonic() - started,
            log_tail=tail,
        )
        log.warning(
            "worker group of %s restarted in %.1f s from %s, %d calls replayed",
            self.model_id,
            restart.seconds,
            restart.restored_from or "its initial weights",
            restart.replayed,
        )
        self.hooks.on_restart(restart)

    def _load(self, point: _RestartPoint | None, calls: Sequence[ReplayCall]) -> None:
        """Bring the group to ``point`` (its initial weights if None), then replay ``calls``."""
        if point is not None:
            self.group.transport.load_state(str(point.path), point.with_optimizer)
        for call in calls:
            if call.op == "forward_backward":
                self.group.transport.forward(call.datums or {}, call.options)
            else:
                self.group.transport.optim_step(call.options)

    def recover(self, path: str | Path | None, with_optimizer: bool = True) -> int:
        """Rebuild the model as its client last saw it, after its owner was restarted: load
        the restart point at ``path`` (None: the initial weights the group started with),
        then replay the calls journaled after it. Returns how many were replayed."""
        point = _RestartPoint(Path(path), with_optimizer) if path is not None else None
        calls = self._journal.resume(point.path if point is not None else None) if self._journal is not None else []
        self._call(lambda: self._load(point, calls))
        with self._lock:
            self._restart_point = point
            self._since_restart_point = list(calls)
            self._steps_since_save = sum(call.op == "optim_step" for call in calls)
        return len(calls)

    def _autosave(self, root: Path) -> None:
        """Save the restart point into whichever of ``root``'s two folders is not the
        current one, so a save cut short never leaves the model without one."""
        current = self._restart_point.path if self._restart_point is not None else None
        target = next(root / name for name in ("a", "b") if root / name != current)
        shutil.rmtree(target, ignore_errors=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        # The step itself was applied and is answered either way: the calls since the
        # last restart point stay kept until a save succeeds.
        try:
            self.group.transport.save_state(str(target), True)
        except WorkerGroupLost as exc:
            log.warning("the group of %s was lost saving its restart point (%s); the next call restarts it", self.model_id, exc)
            self._lost = exc
            return
        except WorkerGroupError as exc:
            log.warning("could not save the restart point of %s (%s); the calls since the last one stay kept", self.model_id, exc)
            return
        self._set_restart_point(_RestartPoint(target, True))
        self.hooks.on_saved(target)

    def _set_restart_point(self, point: _RestartPoint) -> None:
        if self._journal is not None:
            self._journal.start(point.path)
        self._restart_point = point
        self._since_restart_point = []
        self._steps_since_save = 0

    # --- lifecycle ------------------------------------------------------------------------------

    def rank_pids(self) -> dict[int, int]:
        """Each rank's process id."""
        return self._call(lambda: self.group.rank_pids())

    def stop(self) -> None:
        """End the group (after the call in flight, if any); every rank exits."""
        with self._lock:
            self.group.stop()

    def __repr__(self) -> str:
        return f"WorkerGroupEngine(model={self.config.model!r}, ranks={self.ranks}, log={str(self.log_path)!r})"
