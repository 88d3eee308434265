"""Training requests: create_model, forward_backward, optim_step, save/load weights.

Every request that changes or reads a model's weights is a future on the model's
ordered lane (see `Scheduler`). Submission does the cheap checks at once, so a bad
request gets a 4xx with a reason instead of a failed future: the model must be the
caller's, the loss must exist and its inputs must fit, names must be valid. A refused
request still consumes its ``seq_id``, otherwise every later request of that client
would wait for it.

Engines are built lazily: by the ``create_model`` job, or on first use after a
restart from the model's last saved (or loaded) training state; steps taken after
that state are lost with the old process, which the log says.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from nexrl_tinker.server.cloud import Cloud, training_spec_of
from nexrl_tinker.server.codec import (
    PROTO_CONTENT_TYPE,
    FwdBwdRequest,
    encode_forward_backward_output,
)
from nexrl_tinker.server.engines import TrainingSpec, WeightsRef
from nexrl_tinker.server.errors import ApiError, BadRequest, RequestFailed
from nexrl_tinker.server.futures import Outcome
from nexrl_tinker.server.ids import (
    check_checkpoint_name,
    checkpoint_path,
    model_id_for,
    new_sampler_id,
    parse_tinker_path,
)
from nexrl_tinker.server.scheduler import Job
from nexrl_tinker.server.schemas import (
    CreateModelBody,
    LoadWeightsBody,
    OptimStepBody,
    SaveWeightsBody,
    SaveWeightsForSamplerBody,
)
from nexrl_tinker.server.store import CheckpointRow, ModelRow, SamplerRow

__all__ = ["TrainingService", "normalise_metrics"]

log = logging.getLogger("nexrl_tinker.server")


def normalise_metrics(metrics: Mapping[str, float], default_reduction: str = "mean") -> dict[str, float]:
    """Every key as ``name:reduction`` with exactly one colon: the SDK splits on it to
    merge chunked results and crashes on anything else."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        name, sep, reduction = str(key).rpartition(":")
        if not sep:
            name, reduction = str(key), default_reduction
        out[f"{name.replace(':', '_')}:{reduction}"] = float(value)
    return out


@attrs.frozen
class PreparedBatch:
    """Engine datums for one forward_backward chunk, and how to regroup the outputs."""

    datums: list[Any]
    columns: list[int]
    """Per request datum: 0 for a plain datum, K when its [T, K] targets became K datums."""


def prepare_datums(request: FwdBwdRequest) -> PreparedBatch:
    """Turn decoded datums into engine datums; raises ValueError naming the datum.

    ``target_tokens`` of shape [T, K] (several targets per position, the SDK's sparse
    case) with ``cross_entropy`` is the sum of K ordinary cross-entropy terms, so it
    runs as K datums with the same input; the logprobs come back as [T, K].
    """
    from nexrl_fsdp.types import Datum

    if not request.data:
        raise ValueError("forward_backward needs at least one datum")
    datums: list[Any] = []
    columns: list[int] = []
    for index, datum in enumerate(request.data):
        length = len(datum.tokens)
        inputs = dict(datum.inputs)
        targets = inputs.get("target_tokens")
        if targets is None:
            raise ValueError(f"datum {index}: loss_fn_inputs needs 'target_tokens'")
        for key, array in inputs.items():
            if array.ndim not in (1, 2) or array.shape[0] != length:
                raise ValueError(
                    f"datum {index}: loss_fn_inputs[{key!r}] has shape {list(array.shape)} but the model input has "
                    f"{length} tokens; each position needs one value (or one row of K values)"
                )
        width = targets.shape[1] if targets.ndim == 2 else 0
        if width <= 1:
            flat = {key: (array[:, 0] if array.ndim == 2 and array.shape[1] == 1 else array) for key, array in inputs.items()}
            bad = [key for key, array in flat.items() if array.ndim != 1]
            if bad:
                raise ValueError(f"datum {index}: loss_fn_inputs {bad} are 2-D but target_tokens is 1-D")
            datums.append(Datum(input_tokens=datum.tokens, loss_fn_inputs=_typed(flat)))
            columns.append(0)
            continue
        if request.loss_fn != "cross_entropy":
            raise ValueError(
                f"datum {index}: target_tokens of shape [T, K] (several targets per position) work with "
                f"cross_entropy only, not {request.loss_fn!r}"
            )
        extra = sorted(set(inputs) - {"target_tokens", "weights"})
        if extra:
            raise ValueError(f"datum {index}: with [T, K] target_tokens only 'weights' may accompany them, got {extra}")
        weights = inputs.get("weights")
        if weights is None:
            weights = np.ones_like(targets, dtype=np.float32)
        elif weights.ndim == 1:
            weights = np.repeat(weights[:, None], width, axis=1)
        elif weights.shape != targets.shape:
            raise ValueError(f"datum {index}: weights shape {list(weights.shape)} != target_tokens shape {list(targets.shape)}")
        for column in range(width):
            datums.append(
                Datum(
                    input_tokens=datum.tokens,
                    loss_fn_inputs=_typed({"target_tokens": targets[:, column], "weights": weights[:, column]}),
                )
            )
        columns.append(width)
    return PreparedBatch(datums, columns)


def _typed(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for key, array in inputs.items():
        if key == "target_tokens":
            if np.issubdtype(array.dtype, np.floating) and not np.all(np.mod(array, 1) == 0):
                raise ValueError("target_tokens must be integers")
            out[key] = array.astype(np.int64)
        else:
            out[key] = array.astype(np.float32)
    return out


def regroup_outputs(prepared: PreparedBatch, outputs: list[Any]) -> list[dict[str, np.ndarray]]:
    grouped = []
    cursor = 0
    for width in prepared.columns:
        if width == 0:
            grouped.append({"logprobs": np.asarray(outputs[cursor].logprobs, dtype=np.float32)})
            cursor += 1
        else:
            stacked = np.stack([np.asarray(o.logprobs, dtype=np.float32) for o in outputs[cursor : cursor + width]], axis=1)
            grouped.append({"logprobs": stacked})
            cursor += width
    return grouped


class TrainingService:
    def __init__(self, cloud: Cloud) -> None:
        self.cloud = cloud
        self._seq_lock = threading.Lock()
        self._losses: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}

    # --- engines ------------------------------------------------------------------------------

    def _loss(self, name: str, config: Mapping[str, Any]) -> Any:
        """The built loss for submission checks, cached per (name, config): building one
        walks the plugin registry."""
        from nexrl_fsdp.loss_fns import build_loss_fn

        key = (name, tuple(sorted((k, str(v)) for k, v in config.items())))
        with self._seq_lock:
            loss = self._losses.get(key)
        if loss is None:
            loss = build_loss_fn(name, config)
            with self._seq_lock:
                if len(self._losses) > 256:
                    self._losses.clear()
                self._losses[key] = loss
        return loss

    def engine_for(self, model_id: str) -> Any:
        """The model's engine; after a restart, rebuilt from its last saved state."""

        def build() -> Any:
            model = self.cloud.store.get_model(model_id)
            if model is None:
                raise RequestFailed(f"model {model_id!r} no longer exists", "user")
            engine = self.cloud.engines.new_training_engine(training_spec_of(model))
            if model.state_dir:
                if not Path(model.state_dir).is_dir():
                    raise RequestFailed(
                        f"model {model_id!r} has to be rebuilt but its last saved state {model.state_dir} was deleted; "
                        f"create a training client from a checkpoint instead",
                        "user",
                    )
                engine.load_state(model.state_dir, load_optimizer=model.state_has_optimizer)
                log.warning("rebuilt the engine of %s from its last saved state %s", model_id, model.state_dir)
            elif model.status == "ready":
                log.warning("rebuilt the engine of %s from its initial weights (it never saved a state)", model_id)
            return engine

        return self.cloud.engines.training_or_build(model_id, build)

    # --- submission helpers ---------------------------------------------------------------------

    def _usable_model(self, owner: str, model_id: str) -> ModelRow:
        model = self.cloud.own_model(owner, model_id)
        if model.status == "failed":
            raise BadRequest(f"model {model_id!r} could not be created: {model.error}")
        if not self.cloud.scheduler.has_lane(model_id):
            self.cloud.scheduler.open_ordered(model_id, self.cloud.store.lane_last_seq(model_id) + 1)
        return model

    def _seq(self, model: ModelRow, seq_id: int | None) -> int:
        if seq_id is not None:
            return seq_id
        with self._seq_lock:  # clients that send no seq_id run after everything before them
            seq = self.cloud.store.lane_last_seq(model.model_id) + 1
            self.cloud.store.bump_last_seq(model.model_id, seq)
            return seq

    def _submit(
        self,
        owner: str,
        model: ModelRow,
        seq_id: int | None,
        kind: str,
        prepare: Callable[[], Callable[[], Outcome]],
    ) -> dict[str, Any]:
        """Dedupe on ``(model, seq_id)``, validate via ``prepare`` (which returns the job
        body), record the future and queue the job. A resubmission this process has not
        seen (one from before a restart) is validated again, then found by the unique
        index of the futures table."""
        seq = self._seq(model, seq_id)
        existing = self.cloud.book.known(model.model_id, seq)
        if existing is not None:  # a resubmission: same future, nothing runs twice
            return {"request_id": existing.request_id, "model_id": model.model_id}
        try:
            run = prepare()
        except (ApiError, ValueError) as exc:
            self.cloud.scheduler.skip(model.model_id, seq)
            self.cloud.store.bump_last_seq(model.model_id, seq)
            if isinstance(exc, ApiError):
                raise
            raise BadRequest(str(exc)) from None
        row, is_new = self.cloud.book.create(owner, model.model_id, seq, kind)
        if is_new:
            self.cloud.scheduler.submit_ordered(model.model_id, Job(row.request_id, run, seq=seq))
        return {"request_id": row.request_id, "model_id": model.model_id}

    # --- create / info --------------------------------------------------------------------------

    def create_model(self, owner: str, body: CreateModelBody) -> dict[str, Any]:
        session = self.cloud.own_session(owner, body.session_id, active=True)
        base_model = self.cloud.check_base_model(body.base_model)
        _check_optimizer(body.optimizer_config)
        lora = body.lora_config
        spec = TrainingSpec(
            base_model=base_model,
            lora_rank=lora.rank if lora is not None else 0,
            lora_seed=(lora.seed or 0) if lora is not None else 0,
            train_mlp=lora.train_mlp if lora is not None else True,
            train_attn=lora.train_attn if lora is not None else True,
            train_unembed=lora.train_unembed if lora is not None else True,
        )
        try:
            spec.engine_config()
        except ValueError as exc:
            raise BadRequest(f"invalid lora_config: {exc}") from None
        model_id = model_id_for(session.session_id, body.model_seq_id)

        def run() -> Outcome:
            try:
                self.cloud.engines.training_or_build(model_id, lambda: self.cloud.engines.new_training_engine(spec))
            except Exception as exc:
                self.cloud.store.update_model(model_id, status="failed", error=str(exc))
                raise
            self.cloud.store.update_model(model_id, status="ready")
            return Outcome.json({"model_id": model_id, "type": "create_model"})

        return self._create(owner, session.session_id, body.model_seq_id, model_id, spec, body.user_metadata, "CreateModel", run)

    def _create(
        self,
        owner: str,
        session_id: str,
        model_seq_id: int,
        model_id: str,
        spec: TrainingSpec,
        user_metadata: dict[str, Any] | None,
        kind: str,
        run: Callable[[], Outcome],
    ) -> dict[str, Any]:
        existing = self.cloud.store.get_model(model_id)
        if existing is not None:
            if existing.owner != owner:
                raise BadRequest(f"model {model_id!r} exists and belongs to another API key")
            return {"request_id": existing.create_request_id, "model_id": model_id}
        row, is_new = self.cloud.book.create(owner, model_id, 0, kind)
        if not is_new:
            return {"request_id": row.request_id, "model_id": model_id}
        now = time.time()
        self.cloud.store.add_model(
            ModelRow(
                model_id=model_id,
                session_id=session_id,
                model_seq_id=model_seq_id,
                owner=owner,
                base_model=spec.base_model,
                lora_rank=spec.lora_rank,
                lora_seed=spec.lora_seed,
                train_mlp=spec.train_mlp,
                train_attn=spec.train_attn,
                train_unembed=spec.train_unembed,
                user_metadata=user_metadata,
                created_at=now,
                last_request_time=now,
                create_request_id=row.request_id,
                status="creating",
                last_seq=0,
            )
        )
        self.cloud.scheduler.open_ordered(model_id, 0)
        self.cloud.scheduler.submit_ordered(model_id, Job(row.request_id, run, seq=0))
        return {"request_id": row.request_id, "model_id": model_id}

    def get_info(self, owner: str, model_id: str) -> dict[str, Any]:
        model = self.cloud.own_model(owner, model_id)
        base = self.cloud.base
        return {
            "type": "get_info",
            "model_id": model.model_id,
            "model_data": {
                "arch": base.arch,
                "model_name": model.base_model,
                # A local directory: TrainingClient.get_tokenizer() loads it offline.
                "tokenizer_id": str(base.directory),
            },
            "is_lora": model.lora_rank > 0,
            "lora_rank": model.lora_rank if model.lora_rank > 0 else None,
            "model_name": model.base_model,
            "optimizer_config": {"type": "adamw"},
        }

    # --- forward / backward / optimizer -----------------------------------------------------------

    def forward_backward(self, owner: str, request: FwdBwdRequest) -> dict[str, Any]:
        model = self._usable_model(owner, request.model_id)
        kind = "Forward" if request.forward_only else "ForwardBackward"

        def prepare() -> Callable[[], Outcome]:
            from nexrl_fsdp.loss_fns import check_datums

            prepared = prepare_datums(request)
            check_datums(prepared.datums, self._loss(request.loss_fn, request.loss_fn_config), self.cloud.base.vocab_size)

            def run() -> Outcome:
                engine = self.engine_for(model.model_id)
                call = engine.forward if request.forward_only else engine.forward_backward
                result = call(prepared.datums, request.loss_fn, request.loss_fn_config)
                metrics = normalise_metrics(result.metrics)
                metrics["num_sequences:sum"] = float(len(request.data))
                outputs = regroup_outputs(prepared, result.outputs)
                return Outcome("done", PROTO_CONTENT_TYPE, encode_forward_backward_output(outputs, metrics))

            return run

        return self._submit(owner, model, request.seq_id, kind, prepare)

    def optim_step(self, owner: str, body: OptimStepBody) -> dict[str, Any]:
        model = self._usable_model(owner, body.model_id)

        def prepare() -> Callable[[], Outcome]:
            from nexrl_fsdp.types import AdamParams

            if body.optimizer_params is not None and body.adam_params is None:
                raise BadRequest(
                    f"optimizer {body.optimizer_params.get('type')!r} is not supported; this server trains with AdamW "
                    f"(send adam_params)"
                )
            params = AdamParams(**(body.adam_params.model_dump() if body.adam_params is not None else {}))

            def run() -> Outcome:
                result = self.engine_for(model.model_id).optim_step(params)
                return Outcome.json({"metrics": normalise_metrics(result.metrics)})

            return run

        return self._submit(owner, model, body.seq_id, "OptimStep", prepare)

    # --- checkpoints ----------------------------------------------------------------------------

    def save_weights(self, owner: str, body: SaveWeightsBody) -> dict[str, Any]:
        model = self._usable_model(owner, body.model_id)

        def prepare() -> Callable[[], Outcome]:
            name = check_checkpoint_name(body.path or f"step-{int(time.time() * 1000)}")
            path = checkpoint_path(model.model_id, "training", name)
            if not body.overwrite and self.cloud.store.get_checkpoint(path) is not None:
                raise BadRequest(f"checkpoint {path!r} already exists; pass overwrite=True or choose another name")

            def run() -> Outcome:
                engine = self.engine_for(model.model_id)
                directory = self.cloud.files.new_checkpoint_dir(model.model_id, "training", name)
                engine.save_state(directory, include_optimizer=True)
                self._register_checkpoint(model, "training", name, path, directory, body.ttl_seconds, body.user_metadata, True)
                self.cloud.store.update_model(
                    model.model_id, state_dir=str(directory), state_has_optimizer=True, last_request_time=time.time()
                )
                return Outcome.json({"path": path, "type": "save_weights"})

            return run

        return self._submit(owner, model, body.seq_id, "SaveWeights", prepare)

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
        replaced = self.cloud.store.put_checkpoint(
            CheckpointRow(
                tinker_path=path,
                model_id=model.model_id,
                owner=model.owner,
                kind=kind,
                name=name,
                storage_dir=str(directory),
                has_optimizer=has_optimizer,
                created_at=now,
                expires_at=now + ttl_seconds if ttl_seconds else None,
                size_bytes=self.cloud.files.size_of(directory),
                user_metadata=user_metadata,
            )
        )
        if replaced is not None and replaced.storage_dir != str(directory):
            current = self.cloud.store.get_model(model.model_id)
            if current is not None and current.state_dir == replaced.storage_dir:
                self.cloud.store.update_model(model.model_id, state_dir=str(directory))
            self.cloud.delete_checkpoint_files(replaced)

    def save_weights_for_sampler(self, owner: str, body: SaveWeightsForSamplerBody) -> dict[str, Any]:
        model = self._usable_model(owner, body.model_id)
        if body.path is None and body.sampling_session_seq_id is None:
            raise BadRequest("save_weights_for_sampler needs a 'path' (a name) or a 'sampling_session_seq_id'")

        def prepare() -> Callable[[], Outcome]:
            if body.path is not None:
                name = check_checkpoint_name(body.path)
                path = checkpoint_path(model.model_id, "sampler", name)

                def run_named() -> Outcome:
                    engine = self.engine_for(model.model_id)
                    directory = self.cloud.files.new_checkpoint_dir(model.model_id, "sampler", name)
                    # The sampler the client creates next gets these weights from memory.
                    self.cloud.engines.adopt_sampler(WeightsRef("hf", str(directory)), engine.export_sampler(directory))
                    self._register_checkpoint(model, "sampler", name, path, directory, body.ttl_seconds, body.user_metadata, False)
                    return Outcome.json({"path": path, "sampling_session_id": None, "type": "save_weights_for_sampler"})

                return run_named
            seq = int(body.sampling_session_seq_id)  # type: ignore[arg-type]
            existing = self.cloud.store.sampler_by_seq(model.session_id, seq)
            if existing is not None:
                raise BadRequest(
                    f"sampling_session_seq_id {seq} is already used in session {model.session_id!r} "
                    f"by {existing.sampler_id!r}"
                )

            def run_ephemeral() -> Outcome:
                sampler_id = self._ephemeral_sampler(model, seq)
                return Outcome.json({"path": None, "sampling_session_id": sampler_id, "type": "save_weights_for_sampler"})

            return run_ephemeral

        return self._submit(owner, model, body.seq_id, "SaveWeightsForSampler", prepare)

    def _ephemeral_sampler(self, model: ModelRow, seq: int) -> str:
        """Snapshot the trainable weights and bind a new sampling session to them."""
        engine = self.engine_for(model.model_id)
        sampler_id = new_sampler_id(model.session_id, seq)
        directory = self.cloud.files.ephemeral_dir(model.model_id, sampler_id)
        engine.save_state(directory, include_optimizer=False)
        self.cloud.store.add_sampler(
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
                created_at=time.time(),
            )
        )
        keep = self.cloud.settings.ephemeral_keep
        old = self.cloud.store.ephemeral_samplers_of_model(model.model_id)[:-keep] if keep > 0 else []
        for sampler in old:
            self.cloud.engines.forget_sampler(sampler.weights_dir or "")
            self.cloud.files.remove(sampler.weights_dir)
        self.cloud.store.delete_samplers([s.sampler_id for s in old])
        return sampler_id

    def weights_ref_of_sampler(self, sampler: SamplerRow) -> WeightsRef:
        if sampler.weights_kind == "base":
            return WeightsRef("base")
        if sampler.weights_kind == "hf":
            return WeightsRef("hf", sampler.weights_dir)
        source = self.cloud.store.get_model(sampler.model_id or "")
        if source is None:
            raise RequestFailed(f"the training run behind sampler {sampler.sampler_id!r} no longer exists", "user")
        return WeightsRef("state", sampler.weights_dir, training_spec_of(source))

    def load_weights(self, owner: str, body: LoadWeightsBody) -> dict[str, Any]:
        parsed = parse_tinker_path(body.path)
        if parsed.kind != "training":
            raise BadRequest(
                f"load_weights needs a training-state path (tinker://<run>/weights/<name>), got {body.path!r}; "
                f"sampler weights can only be sampled from"
            )
        if body.session_id is not None:
            return self._create_from_state(owner, body, parsed.path)
        if body.model_id is None:
            raise BadRequest("load_weights needs either session_id + model_seq_id (new model) or model_id (existing model)")
        model = self._usable_model(owner, body.model_id)

        def prepare() -> Callable[[], Outcome]:
            checkpoint = self.cloud.own_checkpoint(owner, parsed.path)

            def run() -> Outcome:
                engine = self.engine_for(model.model_id)
                engine.load_state(checkpoint.storage_dir, load_optimizer=body.optimizer)
                self.cloud.store.update_model(
                    model.model_id, state_dir=checkpoint.storage_dir, state_has_optimizer=body.optimizer
                )
                return Outcome.json({"path": parsed.path, "model_id": model.model_id, "type": "load_weights"})

            return run

        return self._submit(owner, model, body.seq_id, "LoadWeights", prepare)

    def _create_from_state(self, owner: str, body: LoadWeightsBody, path: str) -> dict[str, Any]:
        if body.model_seq_id is None:
            raise BadRequest("load_weights with session_id also needs model_seq_id")
        session = self.cloud.own_session(owner, body.session_id or "", active=True)
        _check_optimizer(body.optimizer_config)
        checkpoint = self.cloud.own_checkpoint(owner, path)
        source = self.cloud.store.get_model(checkpoint.model_id)
        if source is None:
            raise BadRequest(f"the training run that saved {path!r} no longer exists")
        if body.base_model is not None and self.cloud.check_base_model(body.base_model) != source.base_model:
            raise BadRequest(f"checkpoint {path!r} was trained from {source.base_model!r}, not {body.base_model!r}")
        if body.optimizer and not checkpoint.has_optimizer:
            raise BadRequest(f"checkpoint {path!r} was saved without optimizer state; load it without the optimizer")
        spec = training_spec_of(source)
        model_id = model_id_for(session.session_id, body.model_seq_id)
        user_metadata = body.user_metadata if body.user_metadata is not None else source.user_metadata

        def run() -> Outcome:
            try:
                engine = self.cloud.engines.training_or_build(
                    model_id, lambda: self.cloud.engines.new_training_engine(spec)
                )
                engine.load_state(checkpoint.storage_dir, load_optimizer=body.optimizer)
            except Exception as exc:
                self.cloud.engines.release_training(model_id)
                self.cloud.store.update_model(model_id, status="failed", error=str(exc))
                raise
            self.cloud.store.update_model(
                model_id, status="ready", state_dir=checkpoint.storage_dir, state_has_optimizer=body.optimizer
            )
            return Outcome.json({"path": path, "model_id": model_id, "type": "load_weights"})

        return self._create(owner, session.session_id, body.model_seq_id, model_id, spec, user_metadata, "LoadWeights", run)


def _check_optimizer(config: Any) -> None:
    kind = getattr(config, "type", "adamw") if config is not None else "adamw"
    if kind != "adamw":
        raise BadRequest(f"optimizer {kind!r} is not supported; this server trains with AdamW ('adamw')")
