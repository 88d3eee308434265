"""Training operations on the engine pool, the same for every protocol.

Every request that changes or reads a model's weights is a future on the model's
ordered lane (see `Scheduler`). `TrainingOps.submit` is the submission rule: a
resubmitted ``(model, seq_id)`` gets the same future and nothing runs twice; the
protocol's ``prepare`` does the cheap checks at once, so a bad request gets a 4xx
with a reason instead of a failed future; a refused request still consumes its
``seq_id``, otherwise every later request of that client would wait for it.

The rest are the engine calls that the protocol's jobs make on a compute thread
(forward/backward, optimizer step, save, export for sampling or download, load,
ephemeral snapshot) and the
bookkeeping that goes with them (checkpoint rows, the model's last state). Protocols
decode requests into engine records before and encode results after.

Engines are built lazily: when the model is created, or on first use after a
restart from the model's last saved (or loaded) training state. A model on a worker
group saves that state itself every ``worker_save_every`` optimizer steps and journals
the calls that change it in between, so a restarted service rebuilds it as its client
last saw it; a model in this process loses the steps taken since its client last saved,
which the log says. A group that loses a rank restarts itself without losing anything
(`nexrl_core.training.worker_groups`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from nexrl_core.config.lora import LoraSettings
from nexrl_core.training.worker_groups import GroupHooks, GroupRestart
from nexrl_engine.config import TrainingSpec
from nexrl_service.engines import WeightsRef
from nexrl_service.errors import ApiError, BadRequest, RequestFailed, TooManyRequests
from nexrl_service.futures import Outcome
from nexrl_service.scheduler import Job
from nexrl_service.state import ServiceState
from nexrl_service.store import COPY_STATUS, CheckpointRow, ModelRow, RestartRow, SamplerRow

__all__ = ["NewModel", "Prepare", "TrainingOps", "training_spec_of"]

log = logging.getLogger("nexrl_service")

Prepare = Callable[[], Callable[[], Outcome]]
"""Validates a submission (raising `ApiError` or ValueError) and returns the job body."""


@attrs.frozen
class NewModel:
    """A model about to be created: who asks, under which session, and its id (the
    protocol's format)."""

    owner: str
    session_id: str
    model_seq_id: int
    model_id: str
    user_metadata: dict[str, Any] | None = None


def training_spec_of(model: ModelRow) -> TrainingSpec:
    return TrainingSpec(
        base_model=model.base_model,
        lora=LoraSettings(
            rank=model.lora_rank,
            alpha=model.lora_alpha,
            train_mlp=model.train_mlp,
            train_attn=model.train_attn,
            train_unembed=model.train_unembed,
        ),
        lora_seed=model.lora_seed,
    )


class TrainingOps:
    """Submission and engine work for training models."""

    def __init__(self, state: ServiceState) -> None:
        self.state = state
        self._lock = threading.Lock()
        self._losses: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}

    # --- engines ------------------------------------------------------------------------------

    def _loss(self, name: str, config: Mapping[str, Any]) -> Any:
        """The built loss for submission checks, cached per (name, config): building one
        walks the plugin registry."""
        from nexrl_engine.loss_fns import build_loss_fn

        key = (name, tuple(sorted((k, str(v)) for k, v in config.items())))
        with self._lock:
            loss = self._losses.get(key)
        if loss is None:
            loss = build_loss_fn(name, config)
            with self._lock:
                if len(self._losses) > 256:
                    self._losses.clear()
                self._losses[key] = loss
        return loss

    def check_datums(self, datums: Sequence[Any], loss_fn: str, loss_fn_config: Mapping[str, Any]) -> None:
        """Raise ValueError unless the loss exists and the datums fit it and the vocabulary."""
        from nexrl_engine.loss_fns import check_datums

        check_datums(datums, self._loss(loss_fn, loss_fn_config), self.state.base.vocab_size)

    def engine_for(self, model_id: str) -> Any:
        """The model's engine; after a restart, rebuilt from its last saved state."""

        def build() -> Any:
            model = self.state.store.get_model(model_id)
            if model is None:
                raise RequestFailed(f"model {model_id!r} no longer exists", "user")
            self._check_not_released(model)
            try:
                engine = self._new_engine(model_id, training_spec_of(model))
            except TooManyRequests as exc:
                raise RequestFailed(f"model {model_id!r} cannot be loaded again: {exc.message}", "user") from None
            if model.state_dir and not Path(model.state_dir).is_dir():
                raise RequestFailed(
                    f"model {model_id!r} has to be rebuilt but its last saved state {model.state_dir} was deleted; "
                    f"create a training client from a checkpoint instead",
                    "user",
                )
            if self.state.engines.groups is not None:  # a group engine: its restart point, then its journal
                replayed = engine.recover(model.state_dir or None, with_optimizer=model.state_has_optimizer)
                log.warning(
                    "rebuilt the worker group of %s from %s and the %d calls journaled after it",
                    model_id,
                    model.state_dir or "its initial weights",
                    replayed,
                )
            elif model.state_dir:
                engine.load_state(model.state_dir, load_optimizer=model.state_has_optimizer)
                log.warning("rebuilt the engine of %s from its last saved state %s", model_id, model.state_dir)
            elif model.status == "ready":
                log.warning("rebuilt the engine of %s from its initial weights (it never saved a state)", model_id)
            return engine

        return self.state.engines.training_or_build(model_id, build)

    def _new_engine(self, model_id: str, spec: TrainingSpec) -> Any:
        """A training engine for the model; a worker group's restart points become the
        model's last state, and its restarts are recorded."""

        def saved(path: Path) -> None:
            self.state.store.update_model(model_id, state_dir=str(path), state_has_optimizer=True)

        def restarted(restart: GroupRestart) -> None:
            self.state.store.add_restart(
                RestartRow(
                    model_id=model_id,
                    at=time.time(),
                    reason=restart.reason,
                    restored_from=restart.restored_from,
                    replayed=restart.replayed,
                    seconds=restart.seconds,
                )
            )

        hooks = GroupHooks(autosave_dir=self.state.files.autosave_dir(model_id), on_saved=saved, on_restart=restarted)
        return self.state.engines.new_training_engine(model_id, spec, hooks)

    def _check_not_released(self, model: ModelRow) -> None:
        """Refuse to load a model again once it was released (terminated, or its session
        ended): nothing would release it a second time."""
        session = self.state.store.get_session(model.session_id)
        if model.status not in ("creating", "ready"):
            raise RequestFailed(f"model {model.model_id!r} is {model.status}; create a new model", "user")
        if session is not None and session.status != "active":
            raise RequestFailed(f"model {model.model_id!r} was released: its session {model.session_id!r} is {session.status}", "user")

    # --- submission ---------------------------------------------------------------------------

    def usable_model(self, owner: str, model_id: str) -> ModelRow:
        """The caller's model, refused if its creation failed; opens its lane after a restart."""
        model = self.state.own_model(owner, model_id)
        if model.status == "failed":
            raise BadRequest(f"model {model_id!r} could not be created: {model.error}")
        if model.status == COPY_STATUS:
            raise BadRequest(
                f"training run {model_id!r} only holds copied weights (copy_weights) and cannot be trained on; "
                f"create a training client from its checkpoint to train from them"
            )
        if not self.state.scheduler.has_lane(model_id):
            self.state.scheduler.open_ordered(model_id, self.state.store.lane_last_seq(model_id) + 1)
        return model

    def _seq(self, model: ModelRow, seq_id: int | None) -> int:
        if seq_id is not None:
            return seq_id
        with self._lock:  # clients that send no seq_id run after everything before them
            seq = self.state.store.lane_last_seq(model.model_id) + 1
            self.state.store.bump_last_seq(model.model_id, seq)
            return seq

    def submit(self, owner: str, model: ModelRow, seq_id: int | None, kind: str, prepare: Prepare) -> str:
        """Dedupe on ``(model, seq_id)``, validate via ``prepare``, record the future and
        queue the job; returns the request id. A resubmission this process has not seen
        (one from before a restart) is validated again, then found by the unique index
        of the futures table."""
        seq = self._seq(model, seq_id)
        existing = self.state.book.known(model.model_id, seq)
        if existing is not None:  # a resubmission: same future, nothing runs twice
            return existing.request_id
        try:
            run = prepare()
        except (ApiError, ValueError) as exc:
            self._consume(model.model_id, seq)
            if isinstance(exc, ApiError):
                raise
            raise BadRequest(str(exc)) from None
        row, is_new = self.state.book.create(owner, model.model_id, seq, kind)
        if is_new:
            self.state.scheduler.submit_ordered(model.model_id, Job(row.request_id, run, seq=seq))
        return row.request_id

    def _consume(self, model_id: str, seq: int) -> None:
        self.state.scheduler.skip(model_id, seq)
        self.state.store.bump_last_seq(model_id, seq)

    def consume_refused(self, owner: str, model_id: str, seq_id: int | None) -> None:
        """A request refused before it reached `submit` (a body the codec cannot take, a
        checkpoint of the wrong kind) still consumes its ``seq_id``: the client has used the
        number, and without it every later request of that client would wait out the gap
        timeout. Nothing happens for a model the caller cannot use, or for a number a
        request was already accepted under (a resubmission keeps its future)."""
        if seq_id is None:
            return
        try:
            model = self.usable_model(owner, model_id)
        except ApiError:
            return
        if self.state.book.known(model.model_id, seq_id) is None:
            self._consume(model.model_id, seq_id)

    @contextlib.contextmanager
    def consuming_refusals(self, owner: str, model_id: str, seq_id: int | None) -> Iterator[None]:
        """Checks a protocol makes before `submit`: what they refuse consumes ``seq_id``
        (`consume_refused`) and is raised on."""
        try:
            yield
        except (ApiError, ValueError):
            self.consume_refused(owner, model_id, seq_id)
            raise

    def submit_after(self, owner: str, model: ModelRow, kind: str, prepare: Prepare) -> str:
        """Validate via ``prepare``, record the future and queue the job behind every job
        submitted to the model so far, without taking a ``seq_id`` (for protocols that
        number only some of a model's requests); returns the request id."""
        try:
            run = prepare()
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        row, _ = self.state.book.create(owner, model.model_id, None, kind)
        self.state.scheduler.submit_after(model.model_id, Job(row.request_id, run))
        return row.request_id

    # --- creation -----------------------------------------------------------------------------

    def create_model(self, new: NewModel, spec: TrainingSpec, answer: Callable[[], Outcome]) -> str:
        """Create a model with fresh weights as the first job of its lane; returns the request id."""
        try:
            spec.engine_config(self.state.engines.dtype)
        except ValueError as exc:
            raise BadRequest(f"invalid lora_config: {exc}") from None

        model_id = new.model_id

        def run() -> Outcome:
            try:
                self.state.engines.training_or_build(model_id, lambda: self._new_engine(model_id, spec))
            except Exception as exc:
                self.state.engines.release_training(model_id)
                self.state.store.update_model(model_id, status="failed", error=str(exc))
                raise
            self.state.store.update_model(model_id, status="ready")
            return answer()

        return self._create(new, spec, "CreateModel", run)

    def source_of(self, checkpoint: CheckpointRow) -> ModelRow:
        """The model that saved ``checkpoint``."""
        source = self.state.store.get_model(checkpoint.model_id)
        if source is None:
            raise BadRequest(f"the training run that saved {checkpoint.path!r} no longer exists")
        return source

    def create_from_checkpoint(self, new: NewModel, checkpoint: CheckpointRow, load_optimizer: bool, answer: Callable[[], Outcome]) -> str:
        """Create a model configured like the one that saved ``checkpoint`` and load it;
        without user metadata of its own it inherits the source model's."""
        if load_optimizer and not checkpoint.has_optimizer:
            raise BadRequest(f"checkpoint {checkpoint.path!r} was saved without optimizer state; load it without the optimizer")
        source = self.source_of(checkpoint)
        spec = training_spec_of(source)
        if new.user_metadata is None:
            new = attrs.evolve(new, user_metadata=source.user_metadata)
        model_id = new.model_id

        def run() -> Outcome:
            try:
                engine = self.state.engines.training_or_build(model_id, lambda: self._new_engine(model_id, spec))
                engine.load_state(checkpoint.storage_dir, load_optimizer=load_optimizer)
            except Exception as exc:
                self.state.engines.release_training(model_id)
                self.state.store.update_model(model_id, status="failed", error=str(exc))
                raise
            self.state.store.update_model(model_id, status="ready", state_dir=checkpoint.storage_dir, state_has_optimizer=load_optimizer)
            return answer()

        return self._create(new, spec, "LoadWeights", run)

    def _create(self, new: NewModel, spec: TrainingSpec, kind: str, run: Callable[[], Outcome]) -> str:
        owner, model_id = new.owner, new.model_id
        existing = self.state.store.get_model(model_id)
        if existing is not None:
            if existing.owner != owner:
                raise BadRequest(f"model {model_id!r} exists and belongs to another API key")
            return existing.create_request_id
        self.state.engines.reserve_group(model_id)
        row, is_new = self.state.book.create(owner, model_id, 0, kind)
        if not is_new:
            return row.request_id
        now = time.time()
        self.state.store.add_model(
            ModelRow(
                model_id=model_id,
                session_id=new.session_id,
                model_seq_id=new.model_seq_id,
                owner=owner,
                base_model=spec.base_model,
                lora_rank=spec.lora.rank,
                lora_alpha=spec.lora.alpha,
                lora_seed=spec.lora_seed,
                train_mlp=spec.lora.train_mlp,
                train_attn=spec.lora.train_attn,
                train_unembed=spec.lora.train_unembed,
                user_metadata=new.user_metadata,
                created_at=now,
                last_request_time=now,
                create_request_id=row.request_id,
                status="creating",
                last_seq=0,
            )
        )
        self.state.scheduler.open_ordered(model_id, 0)
        self.state.scheduler.submit_ordered(model_id, Job(row.request_id, run, seq=0))
        return row.request_id

    # --- engine work (on compute threads) ---------------------------------------------------------

    def forward(self, model_id: str, datums: Sequence[Any], loss_fn: str, loss_fn_config: Mapping[str, Any], backward: bool) -> Any:
        """``Engine.forward_backward`` (or ``forward``) on the model's engine."""
        engine = self.engine_for(model_id)
        call = engine.forward_backward if backward else engine.forward
        return call(list(datums), loss_fn, dict(loss_fn_config))

    def optim_step(self, model_id: str, params: Any) -> Any:
        return self.engine_for(model_id).optim_step(params)

    def save_state(
        self,
        model: ModelRow,
        name: str,
        path: str,
        ttl_seconds: int | None,
        user_metadata: dict[str, Any] | None,
    ) -> None:
        """Save the training state (with the optimizer) as checkpoint ``path``; it becomes
        the state a restarted server rebuilds the model from."""
        engine = self.engine_for(model.model_id)
        directory = self.state.files.new_checkpoint_dir(model.model_id, "training", name)
        engine.save_state(directory, include_optimizer=True)
        self._register_checkpoint(model, "training", name, path, directory, ttl_seconds, user_metadata, True)
        self.state.store.update_model(model.model_id, state_dir=str(directory), state_has_optimizer=True, last_request_time=time.time())

    def export_sampler(
        self,
        model: ModelRow,
        name: str,
        path: str,
        ttl_seconds: int | None,
        user_metadata: dict[str, Any] | None,
    ) -> None:
        """Export the weights for sampling as checkpoint ``path``."""
        engine = self.engine_for(model.model_id)
        directory = self.state.files.new_checkpoint_dir(model.model_id, "sampler", name)
        # The sampler the client creates next gets these weights from memory.
        self.state.engines.adopt_sampler(WeightsRef("hf", str(directory)), engine.export_sampler(directory))
        self._register_checkpoint(model, "sampler", name, path, directory, ttl_seconds, user_metadata, False)

    def export_external(
        self,
        model: ModelRow,
        name: str,
        path: str,
        ttl_seconds: int | None,
        user_metadata: dict[str, Any] | None,
        seal: Callable[[Path], None] | None = None,
    ) -> int:
        """Export the weights as the downloadable HF directory of checkpoint ``path``
        (`Engine.export_hf`: LoRA merged, the adapter beside); returns its size in bytes.
        ``seal`` rewrites the files before the checkpoint is recorded (a protocol's
        encryption), so no one can download them unsealed."""
        engine = self.engine_for(model.model_id)
        directory = self.state.files.new_checkpoint_dir(model.model_id, "external", name)
        engine.export_hf(directory)
        if seal is not None:
            try:
                seal(directory)
            except BaseException:
                self.state.files.remove(directory)
                raise
        self._register_checkpoint(model, "external", name, path, directory, ttl_seconds, user_metadata, False)
        return self.state.files.size_of(directory)

    def _register_checkpoint(
        self,
        model: ModelRow,
        kind: str,
        name: str,
        path: str,
        directory: Path,
        ttl_seconds: int | None,
        user_metadata: dict[str, Any] | None,
        has_optimizer: bool,
    ) -> None:
        now = time.time()
        replaced = self.state.store.put_checkpoint(
            CheckpointRow(
                path=path,
                model_id=model.model_id,
                owner=model.owner,
                kind=kind,
                name=name,
                storage_dir=str(directory),
                has_optimizer=has_optimizer,
                created_at=now,
                expires_at=now + ttl_seconds if ttl_seconds else None,
                size_bytes=self.state.files.size_of(directory),
                user_metadata=user_metadata,
            )
        )
        if replaced is not None and replaced.storage_dir != str(directory):
            current = self.state.store.get_model(model.model_id)
            if current is not None and current.state_dir == replaced.storage_dir:
                self.state.store.update_model(model.model_id, state_dir=str(directory))
            self.state.forget_checkpoint_files(replaced)

    def ephemeral_sampler(self, model: ModelRow, seq: int, sampler_id: str, *, inflight: bool = False) -> None:
        """Snapshot the trainable weights and bind the new sampling session ``sampler_id``
        to them; only the newest ``ephemeral_keep`` snapshots of a model are kept.

        An ``inflight`` save also rebinds the model's earlier inflight sessions to the
        new snapshot, whose predecessor is then removed: every inflight session samples
        from the newest inflight save, never from older weights than at its creation."""
        engine = self.engine_for(model.model_id)
        directory = self.state.files.ephemeral_dir(model.model_id, sampler_id)
        engine.save_state(directory, include_optimizer=False)
        fed = self.state.engines.training_sampler(model.model_id)
        if fed is not None:  # a worker group's weights, pushed: the sampler does not read them back
            self.state.engines.adopt_sampler(WeightsRef("state", str(directory)), fed)
        self.state.store.add_sampler(
            SamplerRow(
                sampler_id=sampler_id,
                session_id=model.session_id,
                seq=seq,
                owner=model.owner,
                base_model=model.base_model,
                model_path=None,
                model_id=model.model_id,
                weights_kind="state",
                weights_dir=str(directory),
                ephemeral=True,
                inflight=inflight,
                created_at=time.time(),
            )
        )
        if inflight:
            self._forget_weights(self.state.store.rebind_inflight_samplers(model.model_id, str(directory)))
        keep = self.state.settings.ephemeral_keep
        snapshots = [sampler for sampler in self.state.store.ephemeral_samplers_of_model(model.model_id) if not sampler.inflight]
        old = snapshots[:-keep] if keep > 0 else []
        self._forget_weights([sampler.weights_dir or "" for sampler in old])
        self.state.store.delete_samplers([s.sampler_id for s in old])

    def _forget_weights(self, directories: list[str]) -> None:
        for directory in directories:
            self.state.engines.forget_sampler(directory)
            self.state.files.remove(directory)

    def load_state(self, model: ModelRow, checkpoint: CheckpointRow, load_optimizer: bool) -> None:
        """Load ``checkpoint`` into the model's engine; it becomes the model's last state."""
        engine = self.engine_for(model.model_id)
        engine.load_state(checkpoint.storage_dir, load_optimizer=load_optimizer)
        self.state.store.update_model(model.model_id, state_dir=checkpoint.storage_dir, state_has_optimizer=load_optimizer)
