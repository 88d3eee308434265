"""Training routes' work: create_model, forward_backward, optim_step, save/load/export weights.

The Tinker side of training: turning the SDK's bodies and datums into engine records
(``[T, K]`` target tokens become K datums), model ids and ``tinker://`` paths, and
the response shapes (metrics keyed ``name:reduction``, protobuf forward outputs).
Submission order, deduplication, validation of the loss inputs and every engine call
are the runtime's `TrainingOps`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import numpy as np

from nexrl_core.config.lora import LoraSettings
from nexrl_engine.config import TrainingSpec
from nexrl_service.runtime import BadRequest, ModelRow, NewModel, Outcome, Prepare, ServiceState, TrainingOps, check_checkpoint_name
from nexrl_tinker.server.age import AgeRecipients
from nexrl_tinker.server.codec import (
    PROTO_CONTENT_TYPE,
    FwdBwdRequest,
    encode_forward_backward_output,
)
from nexrl_tinker.server.ids import (
    checkpoint_path,
    model_id_for,
    new_sampler_id,
    parse_tinker_path,
)
from nexrl_tinker.server.schemas import (
    AdamParamsBody,
    CreateModelBody,
    LoadWeightsBody,
    OptimStepBody,
    SaveWeightsBody,
    SaveWeightsExternalBody,
    SaveWeightsForSamplerBody,
)

__all__ = ["TrainingService", "normalise_metrics"]

SAMPLER_KINDS = ("snapshot", "inflight")
"""A sampler save's kinds (the SDK's ``SamplingClientKind``): fixed weights, or the model's
mutable inflight target, which every later inflight save moves for every inflight session."""


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
    from nexrl_engine.types import Datum

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
    def __init__(self, state: ServiceState) -> None:
        self.state = state
        self.ops = TrainingOps(state)

    def _submit(self, owner: str, model: ModelRow, seq_id: int | None, kind: str, prepare: Prepare) -> dict[str, Any]:
        return {"request_id": self.ops.submit(owner, model, seq_id, kind, prepare), "model_id": model.model_id}

    # --- create / info --------------------------------------------------------------------------

    def create_model(self, owner: str, body: CreateModelBody) -> dict[str, Any]:
        session = self.state.own_session(owner, body.session_id, active=True)
        base_model = self.state.check_base_model(body.base_model)
        _check_optimizer(body.optimizer_config)
        lora = body.lora_config
        spec = TrainingSpec(
            base_model=base_model,
            lora=LoraSettings() if lora is None else lora.settings(),
            lora_seed=(lora.seed or 0) if lora is not None else 0,
        )
        model_id = model_id_for(session.session_id, body.model_seq_id)
        new = NewModel(owner, session.session_id, body.model_seq_id, model_id, body.user_metadata)
        request_id = self.ops.create_model(new, spec, lambda: Outcome.json({"model_id": model_id, "type": "create_model"}))
        return {"request_id": request_id, "model_id": model_id}

    def get_info(self, owner: str, model_id: str) -> dict[str, Any]:
        model = self.state.own_model(owner, model_id)
        base = self.state.base
        return {
            "type": "get_info",
            "model_id": model.model_id,
            "model_data": {
                "arch": base.arch,
                "model_name": base.name,
                # Loaded by name from this machine's cache or the service's /hf (nexrl_service.hub).
                "tokenizer_id": base.tokenizer_id,
            },
            "is_lora": model.lora_rank > 0,
            "lora_rank": model.lora_rank if model.lora_rank > 0 else None,
            "model_name": base.name,
            "optimizer_config": {"type": "adamw"},
        }

    # --- forward / backward / optimizer -----------------------------------------------------------

    def forward_backward(self, owner: str, request: FwdBwdRequest) -> dict[str, Any]:
        model = self.ops.usable_model(owner, request.model_id)
        kind = "Forward" if request.forward_only else "ForwardBackward"

        def prepare() -> Callable[[], Outcome]:
            prepared = prepare_datums(request)
            self.ops.check_datums(prepared.datums, request.loss_fn, request.loss_fn_config)

            def run() -> Outcome:
                result = self.ops.forward(
                    model.model_id, prepared.datums, request.loss_fn, request.loss_fn_config, not request.forward_only
                )
                metrics = normalise_metrics(result.metrics)
                metrics["num_sequences:sum"] = float(len(request.data))
                outputs = regroup_outputs(prepared, result.outputs)
                return Outcome("done", PROTO_CONTENT_TYPE, encode_forward_backward_output(outputs, metrics))

            return run

        return self._submit(owner, model, request.seq_id, kind, prepare)

    def optim_step(self, owner: str, body: OptimStepBody) -> dict[str, Any]:
        model = self.ops.usable_model(owner, body.model_id)

        def prepare() -> Callable[[], Outcome]:
            if body.optimizer_params is not None and body.adam_params is None:
                raise BadRequest(
                    f"optimizer {body.optimizer_params.get('type')!r} is not supported; this server trains with AdamW (send adam_params)"
                )
            params = (body.adam_params or AdamParamsBody()).settings()

            def run() -> Outcome:
                result = self.ops.optim_step(model.model_id, params)
                return Outcome.json({"metrics": normalise_metrics(result.metrics)})

            return run

        return self._submit(owner, model, body.seq_id, "OptimStep", prepare)

    # --- checkpoints ----------------------------------------------------------------------------

    def save_weights(self, owner: str, body: SaveWeightsBody) -> dict[str, Any]:
        model = self.ops.usable_model(owner, body.model_id)

        def prepare() -> Callable[[], Outcome]:
            name = check_checkpoint_name(body.path or f"step-{int(time.time() * 1000)}")
            path = checkpoint_path(model.model_id, "training", name)
            if not body.overwrite and self.state.store.get_checkpoint(path) is not None:
                raise BadRequest(f"checkpoint {path!r} already exists; pass overwrite=True or choose another name")

            def run() -> Outcome:
                self.ops.save_state(model, name, path, body.ttl_seconds, body.user_metadata)
                return Outcome.json({"path": path, "type": "save_weights"})

            return run

        return self._submit(owner, model, body.seq_id, "SaveWeights", prepare)

    def save_weights_for_sampler(self, owner: str, body: SaveWeightsForSamplerBody) -> dict[str, Any]:
        with self.ops.consuming_refusals(owner, body.model_id, body.seq_id):
            model = self.ops.usable_model(owner, body.model_id)
            if body.path is None and body.sampling_session_seq_id is None:
                raise BadRequest("save_weights_for_sampler needs a 'path' (a name) or a 'sampling_session_seq_id'")
            if body.kind not in SAMPLER_KINDS:
                raise BadRequest(f"save_weights_for_sampler kind {body.kind!r}: one of {', '.join(SAMPLER_KINDS)}")
            if body.kind == "inflight" and body.path is not None:
                raise BadRequest(
                    "an inflight save names no path: it rebinds the model's inflight sampling sessions (give sampling_session_seq_id)"
                )

        def prepare() -> Callable[[], Outcome]:
            if body.path is not None:
                name = check_checkpoint_name(body.path)
                path = checkpoint_path(model.model_id, "sampler", name)

                def run_named() -> Outcome:
                    self.ops.export_sampler(model, name, path, body.ttl_seconds, body.user_metadata)
                    return Outcome.json({"path": path, "sampling_session_id": None, "type": "save_weights_for_sampler"})

                return run_named
            seq = int(body.sampling_session_seq_id)  # type: ignore[arg-type]
            existing = self.state.store.sampler_by_seq(model.session_id, seq)
            if existing is not None:
                raise BadRequest(
                    f"sampling_session_seq_id {seq} is already used in session {model.session_id!r} by {existing.sampler_id!r}"
                )

            def run_ephemeral() -> Outcome:
                sampler_id = new_sampler_id(model.session_id, seq)
                self.ops.ephemeral_sampler(model, seq, sampler_id, inflight=body.kind == "inflight")
                return Outcome.json({"path": None, "sampling_session_id": sampler_id, "type": "save_weights_for_sampler"})

            return run_ephemeral

        return self._submit(owner, model, body.seq_id, "SaveWeightsForSampler", prepare)

    def save_weights_external(self, owner: str, body: SaveWeightsExternalBody) -> dict[str, Any]:
        """The model as a downloadable HF directory, ``tinker://<run>/external_weights/<name>``
        (fetch its files through ``external_weights_urls``); with age recipients every file
        is stored encrypted as ``<name>.age`` (`nexrl_tinker.server.age`)."""
        model = self.ops.usable_model(owner, body.model_id)

        def prepare() -> Callable[[], Outcome]:
            age = AgeRecipients.parse(body.age_encryption_recipients) if body.age_encryption_recipients else None
            name = check_checkpoint_name(body.path)
            path = checkpoint_path(model.model_id, "external", name)

            def run() -> Outcome:
                seal = age.encrypt_directory if age is not None else None
                size = self.ops.export_external(model, name, path, body.ttl_seconds, None, seal)
                return Outcome.json({"path": path, "size_bytes": size, "type": "save_weights_external"})

            return run

        return self._submit(owner, model, body.seq_id, "SaveWeightsExternal", prepare)

    def load_weights(self, owner: str, body: LoadWeightsBody) -> dict[str, Any]:
        if body.session_id is not None:
            return self._create_from_state(owner, body, _training_state_path(body.path))
        if body.model_id is None:
            raise BadRequest("load_weights needs either session_id + model_seq_id (new model) or model_id (existing model)")
        with self.ops.consuming_refusals(owner, body.model_id, body.seq_id):
            parsed_path = _training_state_path(body.path)
            model = self.ops.usable_model(owner, body.model_id)

        def prepare() -> Callable[[], Outcome]:
            checkpoint = self.state.own_checkpoint(owner, parsed_path, public_ok=True)

            def run() -> Outcome:
                self.ops.load_state(model, checkpoint, body.optimizer)
                return Outcome.json({"path": parsed_path, "model_id": model.model_id, "type": "load_weights"})

            return run

        return self._submit(owner, model, body.seq_id, "LoadWeights", prepare)

    def _create_from_state(self, owner: str, body: LoadWeightsBody, path: str) -> dict[str, Any]:
        if body.model_seq_id is None:
            raise BadRequest("load_weights with session_id also needs model_seq_id")
        session = self.state.own_session(owner, body.session_id or "", active=True)
        _check_optimizer(body.optimizer_config)
        checkpoint = self.state.own_checkpoint(owner, path, public_ok=True)
        source = self.ops.source_of(checkpoint)
        if body.base_model is not None and self.state.check_base_model(body.base_model) != source.base_model:
            raise BadRequest(f"checkpoint {path!r} was trained from {source.base_model!r}, not {body.base_model!r}")
        model_id = model_id_for(session.session_id, body.model_seq_id)
        new = NewModel(owner, session.session_id, body.model_seq_id, model_id, body.user_metadata)
        request_id = self.ops.create_from_checkpoint(
            new, checkpoint, body.optimizer, lambda: Outcome.json({"path": path, "model_id": model_id, "type": "load_weights"})
        )
        return {"request_id": request_id, "model_id": model_id}


def _check_optimizer(config: Any) -> None:
    kind = getattr(config, "type", "adamw") if config is not None else "adamw"
    if kind != "adamw":
        raise BadRequest(f"optimizer {kind!r} is not supported; this server trains with AdamW ('adamw')")


def _training_state_path(path: str) -> str:
    """The path of a training state (``tinker://<run>/weights/<name>``), the only kind
    load_weights takes."""
    parsed = parse_tinker_path(path)
    if parsed.kind != "training":
        raise BadRequest(
            f"load_weights needs a training-state path (tinker://<run>/weights/<name>), got {path!r}; "
            f"sampler weights can only be sampled from"
        )
    return parsed.path
