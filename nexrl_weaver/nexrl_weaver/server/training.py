"""Training routes' work: models, forward(-backward) passes, optimizer steps, sampler
exports, checkpoints and loads, in the nex-weaver SDK's shapes.

The Weaver side only: the SDK's bodies and datums in (JSON tensors or an
``http-binary`` pack), model ids and ``weaver://`` paths, the loss names only Weaver
has, and the response shapes (``loss_fn_outputs`` with ``metrics``, both directly and
nested under ``result`` as older SDK code reads them). Submission order (the SDK's
``seq_id``), deduplication of a re-sent submission, validation of loss inputs and
every engine call are the runtime's `TrainingOps`.

Weaver's own loss names map onto the registered losses:

* ``forward_logprob`` (the forward pass of the SDK's ``forward_backward_custom``)
  is a forward pass that returns each target token's logprob;
* ``surrogate`` (its second half) carries ``surrogate_weights`` = d(user loss) /
  d(logprob) per token, and must produce exactly that gradient: it runs as
  ``importance_sampling`` against the current weights' own logprobs (ratio 1), with
  advantages ``-surrogate_weights``, whose gradient by each logprob is the weight.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import attrs
import numpy as np

from nexrl_core.config.adamw import AdamWSettings
from nexrl_core.config.lora import LoraSettings
from nexrl_engine.config import TrainingSpec
from nexrl_service.runtime import (
    BadRequest,
    CheckpointRow,
    Gone,
    ModelRow,
    NewModel,
    Outcome,
    Prepare,
    ServiceState,
    TrainingOps,
    check_checkpoint_name,
)
from nexrl_weaver.server import operations
from nexrl_weaver.server.bodies import flag, obj, optional_int, optional_str, required_str
from nexrl_weaver.server.ids import checkpoint_id, checkpoint_path, new_id, parse_weaver_path
from nexrl_weaver.server.tensors import ResultPack, TensorPack, to_array

__all__ = ["WeaverTraining", "checkpoint_json", "split_context_suffix"]

FORWARD_LOGPROB = "forward_logprob"
SURROGATE = "surrogate"
TERMINATED = "terminated"
INT_INPUTS = frozenset({"target_tokens"})


def split_context_suffix(base_model: str) -> str:
    """``name:262144`` names a long-context variant; the local service serves one model
    at its own context, so the suffix only has to be a number."""
    name, sep, suffix = base_model.rpartition(":")
    return name if sep and suffix.isdigit() else base_model


def _iso(timestamp: float | None) -> str | None:
    return None if timestamp is None else datetime.fromtimestamp(timestamp, tz=timezone.utc).isoformat()


def checkpoint_json(row: CheckpointRow) -> dict[str, Any]:
    kind = "weight_and_optimizer" if row.kind == "training" else "sampling"
    return {
        "id": checkpoint_id(row.path),
        "path": row.path,
        "name": row.name,
        "model_id": row.model_id,
        "checkpoint_type": kind,
        "type": kind,
        "status": "completed",
        "size_bytes": row.size_bytes,
        "ttl_seconds": None if row.expires_at is None else int(row.expires_at - row.created_at),
        "created_at": _iso(row.created_at),
        "expires_at": _iso(row.expires_at),
    }


@attrs.frozen
class ForwardRequest:
    """A decoded forward or forward-backward submission."""

    loss_fn: str
    loss_fn_config: dict[str, Any]
    datums: list[Any]
    datum_ids: list[Any]
    pack_codec: str | None
    """The compression of a ``http-binary`` request: results go back as a pack too."""


def decode_forward(payload: dict[str, Any], pack: TensorPack | None, backward: bool) -> ForwardRequest:
    """The SDK's ``{"payload": {...}}`` forward(-backward) body as engine datums."""
    from nexrl_engine.types import Datum

    key = "forward_backward_input" if backward else "forward_input"
    section = obj(payload.get(key), f"payload.{key}")
    if not section:
        raise BadRequest(f"payload.{key} is required: {{loss_fn, data, loss_fn_config?}}")
    loss_fn = required_str(section, "loss_fn", f"payload.{key}")
    config = obj(section.get("loss_fn_config"), f"payload.{key}.loss_fn_config")
    data = section.get("data")
    if not isinstance(data, list) or not data:
        raise BadRequest(f"payload.{key}.data must be a non-empty list of datums")
    datums, ids = [], []
    for index, raw in enumerate(data):
        where = f"payload.{key}.data[{index}]"
        datum = obj(raw, where)
        if "sample_ref" in datum and datum.get("sample_ref") is not None:
            raise BadRequest(f"{where}: managed-dataset sample_ref datums are not supported by this server; send tokens")
        chunks = obj(datum.get("model_input"), f"{where}.model_input").get("chunks")
        if not isinstance(chunks, list) or not chunks:
            raise BadRequest(f"{where}.model_input.chunks must be a non-empty list")
        tokens: list[int] = []
        for c, chunk in enumerate(chunks):
            chunk = obj(chunk, f"{where}.model_input.chunks[{c}]")
            if chunk.get("type", "encoded_text") != "encoded_text":
                raise BadRequest(f"{where}.model_input.chunks[{c}] is {chunk.get('type')!r}; only encoded_text is supported")
            array = to_array(chunk.get("tokens"), f"{where}.model_input.chunks[{c}].tokens", pack)
            if array.ndim != 1 or array.dtype.kind not in "iu":
                raise BadRequest(f"{where}.model_input.chunks[{c}].tokens must be a 1-D list of integers")
            tokens.extend(int(t) for t in array)
        inputs: dict[str, np.ndarray] = {}
        for name, value in obj(datum.get("loss_fn_inputs"), f"{where}.loss_fn_inputs").items():
            array = to_array(value, f"{where}.loss_fn_inputs.{name}", pack)
            if array.ndim != 1 or len(array) != len(tokens):
                raise BadRequest(
                    f"{where}.loss_fn_inputs.{name} has shape {list(array.shape)} but the model input has "
                    f"{len(tokens)} tokens; each position needs one value"
                )
            if name in INT_INPUTS:
                if array.dtype.kind == "f" and not np.all(np.mod(array, 1) == 0):
                    raise BadRequest(f"{where}.loss_fn_inputs.{name} must hold integers")
                array = array.astype(np.int64)
            else:
                array = array.astype(np.float32)
            inputs[name] = array
        if "target_tokens" not in inputs:
            raise BadRequest(f"{where}.loss_fn_inputs needs 'target_tokens'")
        datums.append(Datum(input_tokens=tokens, loss_fn_inputs=inputs))
        ids.append(datum.get("datum_id"))
    binary = payload.get("tensor_transport") == "http-binary"
    codec = str(payload.get("tensor_compression") or "zstd") if binary else None
    return ForwardRequest(loss_fn, config, datums, ids, codec)


def _without(datum: Any, *keys: str) -> Any:
    return attrs.evolve(datum, loss_fn_inputs={k: v for k, v in datum.loss_fn_inputs.items() if k not in keys})


class WeaverTraining:
    def __init__(self, state: ServiceState) -> None:
        self.state = state
        self.ops = TrainingOps(state)

    # --- models ---------------------------------------------------------------------------------

    def model(self, owner: str, model_id: str) -> ModelRow:
        """The caller's live model: 410 once terminated."""
        model = self.ops.usable_model(owner, model_id)
        if model.status == TERMINATED:
            raise Gone(f"model {model_id!r} was terminated (the client that created it closed); create a new model")
        return model

    def create_model(self, owner: str, session_id: str, body: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
        """The model's JSON and the request id of its creation (None when it already existed)."""
        session = self.state.own_session(owner, session_id, active=True)
        base_model = self.state.check_base_model(split_context_suffix(required_str(body, "base_model")))
        seq = optional_int(body, "model_seq_id", minimum=0)
        mode = optional_str(body, "training_mode") or "lora"
        if mode not in ("lora", "full_ft"):
            raise BadRequest(f"body.training_mode must be 'lora' or 'full_ft', got {mode!r}")
        if seq is not None:
            for existing in self.state.store.models_of_session(session.session_id):
                if existing.model_seq_id == seq:  # a re-sent create: the model it made
                    return self.model_json(existing), None
        lora = obj(body.get("lora_config"), "body.lora_config")
        if mode == "lora":
            rank = optional_int(lora, "rank", "body.lora_config", 1)
            if rank is None:
                raise BadRequest(
                    "body.lora_config.rank is required for training_mode 'lora' (use training_mode 'full_ft' to train every weight)"
                )
        else:
            rank = 0
        spec = TrainingSpec(
            base_model=base_model,
            lora=LoraSettings(
                rank=rank,
                train_mlp=flag(lora, "train_mlp", "body.lora_config", True),
                train_attn=flag(lora, "train_attn", "body.lora_config", True),
                train_unembed=flag(lora, "train_unembed", "body.lora_config", True),
            ),
            lora_seed=optional_int(lora, "seed", "body.lora_config") or 0,
        )
        model_id = new_id()
        metadata = obj(body.get("user_metadata"), "body.user_metadata") or None
        new = NewModel(owner, session.session_id, seq if seq is not None else 0, model_id, metadata)
        request_id = self.ops.create_model(new, spec, lambda: operations.done({"id": model_id}))
        model = self.state.store.get_model(model_id)
        assert model is not None
        return self.model_json(model), request_id

    def model_json(self, model: ModelRow) -> dict[str, Any]:
        mode = "lora" if model.lora_rank > 0 else "full_ft"
        answer: dict[str, Any] = {
            "id": model.model_id,
            "session_id": model.session_id,
            "base_model": self.state.base.name,
            "training_mode": mode,
            "status": model.status,
            # A local directory: TrainingClient.get_tokenizer() loads it offline.
            "tokenizer_path": str(self.state.base.directory),
        }
        if mode == "lora":
            answer["lora_config"] = {
                "rank": model.lora_rank,
                "seed": model.lora_seed,
                "train_mlp": model.train_mlp,
                "train_attn": model.train_attn,
                "train_unembed": model.train_unembed,
            }
        return answer

    def get_model(self, owner: str, model_id: str) -> dict[str, Any]:
        return self.model_json(self.state.own_model(owner, model_id))

    def terminate(self, owner: str, model_id: str) -> dict[str, Any]:
        model = self.state.own_model(owner, model_id)
        if model.status != TERMINATED:
            self.state.store.update_model(model_id, status=TERMINATED)
            self.state.release_model(model_id)
        return {"model_id": model_id, "status": TERMINATED, "terminated": ["trainer", "inference"]}

    # --- forward / backward / optimizer -----------------------------------------------------------

    def forward(self, owner: str, model_id: str, body: dict[str, Any], pack: TensorPack | None, backward: bool) -> str:
        payload = obj(body.get("payload"), "payload")
        if not payload:
            raise BadRequest('the body must be {"payload": {model_id, seq_id, forward_input | forward_backward_input}}')
        model = self.model(owner, model_id)
        seq = optional_int(payload, "seq_id", "payload", 0)
        kind = "ForwardBackward" if backward else "Forward"
        return self.ops.submit(owner, model, seq, kind, self._forward_job(model, payload, pack, backward))

    def _forward_job(self, model: ModelRow, payload: dict[str, Any], pack: TensorPack | None, backward: bool) -> Prepare:
        """Decoding and checks run inside ``prepare``, so a refused request still uses up
        its ``seq_id`` and the requests behind it do not wait for it."""

        def prepare() -> Callable[[], Outcome]:
            request = decode_forward(payload, pack, backward)
            name, config, datums = request.loss_fn, request.loss_fn_config, request.datums
            if name in (FORWARD_LOGPROB, SURROGATE) and config:
                raise BadRequest(f"loss_fn {name!r} takes no loss_fn_config, got {sorted(config)}")
            if name == FORWARD_LOGPROB:
                if backward:
                    raise BadRequest("loss_fn 'forward_logprob' only computes logprobs; send it to forward, not forward_backward")
                datums = [_without(d, *(set(d.loss_fn_inputs) - {"target_tokens"})) for d in datums]
                self.ops.check_datums(datums, "cross_entropy", {})
                run = lambda: self.ops.forward(model.model_id, datums, "cross_entropy", {}, False)  # noqa: E731
            elif name == SURROGATE:
                if not backward:
                    raise BadRequest("loss_fn 'surrogate' applies gradients; send it to forward_backward")
                missing = [i for i, d in enumerate(datums) if "surrogate_weights" not in d.loss_fn_inputs]
                if missing:
                    raise BadRequest(f"loss_fn 'surrogate' needs loss_fn_inputs.surrogate_weights (datums {missing})")
                plain = [_without(d, *(set(d.loss_fn_inputs) - {"target_tokens"})) for d in datums]
                self.ops.check_datums(plain, "cross_entropy", {})
                run = lambda: self._surrogate(model.model_id, datums, plain)  # noqa: E731
            else:
                self.ops.check_datums(datums, name, config)
                run = lambda: self.ops.forward(model.model_id, datums, name, config, backward)  # noqa: E731

            def job() -> Outcome:
                return self._forward_outcome(request, run())

            return job

        return prepare

    def _surrogate(self, model_id: str, datums: list[Any], plain: list[Any]) -> Any:
        current = self.ops.forward(model_id, plain, "cross_entropy", {}, False)
        linear = [
            attrs.evolve(
                p,
                loss_fn_inputs={
                    "target_tokens": p.loss_fn_inputs["target_tokens"],
                    "logprobs": np.asarray(out.logprobs, dtype=np.float32),
                    "advantages": -np.asarray(d.loss_fn_inputs["surrogate_weights"], dtype=np.float32),
                },
            )
            for p, d, out in zip(plain, datums, current.outputs)
        ]
        result = self.ops.forward(model_id, linear, "importance_sampling", {}, True)
        # Report the surrogate's own value, sum(weights * logprob), not the stand-in loss's.
        value = sum(
            float(np.dot(np.asarray(out.logprobs, dtype=np.float64), np.asarray(d.loss_fn_inputs["surrogate_weights"], dtype=np.float64)))
            for d, out in zip(datums, current.outputs)
        )
        return attrs.evolve(result, metrics={**result.metrics, "loss:sum": value})

    @staticmethod
    def _forward_outcome(request: ForwardRequest, result: Any) -> Outcome:
        pack = ResultPack(request.pack_codec) if request.pack_codec is not None else None
        outputs = []
        for datum_id, output in zip(request.datum_ids, result.outputs):
            logprobs = np.asarray(output.logprobs, dtype=np.float32)
            entry: dict[str, Any] = {
                "logprobs": pack.put(logprobs)
                if pack is not None
                else {"data": logprobs.tolist(), "dtype": "float32", "shape": [len(logprobs)]}
            }
            if datum_id is not None:
                entry["datum_id"] = datum_id
            outputs.append(entry)
        metrics = {str(k): float(v) for k, v in result.metrics.items()}
        metrics["num_sequences"] = float(len(outputs))
        response: dict[str, Any] = {"loss_fn_outputs": outputs, "metrics": metrics}
        response["result"] = dict(response)
        if pack is None:
            return operations.done(response)
        meta, wire = pack.finish()
        response["tensor_pack"] = meta
        return operations.packed(response, wire)

    def optim_step(self, owner: str, model_id: str, body: dict[str, Any]) -> str:
        payload = obj(body.get("payload"), "payload")
        model = self.model(owner, model_id)

        def prepare() -> Callable[[], Outcome]:
            adam = obj(payload.get("adam_params"), "payload.adam_params")
            unknown = sorted(set(adam) - {f.name for f in attrs.fields(AdamWSettings)})
            if unknown:
                raise BadRequest(f"payload.adam_params has unknown fields {unknown}")
            try:
                settings = AdamWSettings(**adam)
            except (TypeError, ValueError) as exc:
                raise BadRequest(f"invalid payload.adam_params: {exc}") from None

            def run() -> Outcome:
                result = self.ops.optim_step(model.model_id, settings.to_json())
                return operations.done({"metrics": {k: float(v) for k, v in result.metrics.items()}})

            return run

        return self.ops.submit(owner, model, optional_int(payload, "seq_id", "payload", 0), "OptimStep", prepare)

    # --- sampler exports and checkpoints --------------------------------------------------------

    def export_sampler(self, owner: str, model_id: str, body: dict[str, Any]) -> str:
        model = self.model(owner, model_id)
        seq = optional_int(body, "seq_id", minimum=0)
        ttl = optional_int(body, "ttl_seconds", minimum=1)

        def prepare() -> Callable[[], Outcome]:
            name = check_checkpoint_name(optional_str(body, "path") or f"sampler-{seq if seq is not None else int(time.time() * 1000)}")
            path = checkpoint_path(model.model_id, "sampler", name)

            def run() -> Outcome:
                self.ops.export_sampler(model, name, path, ttl, None)
                return operations.done({"model_path": path, "path": path, "model_id": model.model_id})

            return run

        return self.ops.submit(owner, model, seq, "ExportSampler", prepare)

    def save_checkpoint(self, owner: str, model_id: str, body: dict[str, Any]) -> str:
        model = self.model(owner, model_id)
        kind = optional_str(body, "type") or "weight"
        if kind not in ("weight", "weight_and_optimizer", "sampling"):
            raise BadRequest(f"body.type must be 'weight', 'weight_and_optimizer' or 'sampling', got {kind!r}")
        ttl = optional_int(body, "ttl_seconds", minimum=1)
        name = check_checkpoint_name(optional_str(body, "name") or f"checkpoint-{int(time.time() * 1000)}")
        runtime_kind = "sampler" if kind == "sampling" else "training"
        path = checkpoint_path(model.model_id, runtime_kind, name)

        def prepare() -> Callable[[], Outcome]:
            def run() -> Outcome:
                if runtime_kind == "sampler":
                    self.ops.export_sampler(model, name, path, ttl, None)
                else:
                    self.ops.save_state(model, name, path, ttl, None)
                row = self.state.store.get_checkpoint(path)
                assert row is not None
                return operations.done(checkpoint_json(row))

            return run

        return self.ops.submit_after(owner, model, "SaveCheckpoint", prepare)

    def list_checkpoints(self, owner: str, model_id: str) -> dict[str, Any]:
        """Training state and sampler weights; HF exports are artifacts, not checkpoints."""
        model = self.state.own_model(owner, model_id)
        rows = self.state.store.checkpoints_of_model(model.model_id)
        return {"items": [checkpoint_json(row) for row in rows if row.kind != "external"]}

    def load(self, owner: str, model_id: str, body: dict[str, Any]) -> str:
        model = self.model(owner, model_id)
        parsed = parse_weaver_path(body.get("path"))
        if parsed.kind != "training":
            raise BadRequest(
                f"load needs a training checkpoint (weaver://<model>/checkpoints/<name>), got {parsed.path!r}; "
                f"sampler weights can only be sampled from"
            )
        include_optimizer = flag(body, "include_optimizer")
        checkpoint = self.state.own_checkpoint(owner, parsed.path)
        if include_optimizer and not checkpoint.has_optimizer:
            raise BadRequest(f"checkpoint {parsed.path!r} has no optimizer state; load it with load_state")

        def prepare() -> Callable[[], Outcome]:
            def run() -> Outcome:
                self.ops.load_state(model, checkpoint, include_optimizer)
                return operations.done({"path": parsed.path, "model_id": model.model_id, "include_optimizer": include_optimizer})

            return run

        return self.ops.submit_after(owner, model, "Load", prepare)
