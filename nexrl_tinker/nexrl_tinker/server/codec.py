"""The protobuf side of the wire: ``forward_backward`` requests in, results out.

The schema is the SDK's own module (``tinker.proto.tinker_public_pb2``), imported,
never copied, so the server always speaks exactly the SDK's dialect. Decoding turns
the message into plain records with numpy arrays and rejects anything inconsistent
(odd byte counts, shapes that do not match, broken sparse CSR indices, image chunks
for a text model) with a `BadRequest` that names the datum and the field.

``forward_backward`` may also arrive as JSON (the SDK's pydantic shape) from non-SDK
clients; both forms end up as the same `FwdBwdRequest`.

On the sampling side: a ``SampleRequest``'s ``target_prompt_logprobs`` (JSON ``TensorData``,
dense or sparse CSR) is read into `TargetPromptIds`, which answers in the request's own
layout, and `encode_sample_response` writes ``SampleResponse`` with its top-k matrices
(`TopkRows`) as the SDK's ``TopkLogprobs``.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
from google.protobuf.message import DecodeError

from nexrl_service.runtime import SQL_INT_MAX, BadRequest

__all__ = [
    "FORWARD_BACKWARD_JSON",
    "PROTO_CONTENT_TYPE",
    "FwdBwdDatum",
    "FwdBwdRequest",
    "TargetPromptIds",
    "TopkRows",
    "decode_forward_backward",
    "decode_forward_backward_json",
    "decode_target_prompt_ids",
    "decompress_body",
    "encode_forward_backward_output",
    "encode_sample_response",
]

PROTO_CONTENT_TYPE = "application/x-protobuf"


def _pb() -> Any:
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


@attrs.frozen
class FwdBwdDatum:
    tokens: np.ndarray
    """int64 [T] model input."""
    inputs: dict[str, np.ndarray]
    """``loss_fn_inputs`` as dense arrays, [T] or [T, K]."""


@attrs.frozen
class FwdBwdRequest:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: list[FwdBwdDatum]


def decompress_body(body: bytes, content_encoding: str | None, limit: int) -> bytes:
    """Undo ``Content-Encoding: zstd`` (the SDK's ``proto_compress_fwdbwd``), capped at ``limit`` bytes."""
    encoding = (content_encoding or "").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding != "zstd":
        raise BadRequest(f"unsupported Content-Encoding {content_encoding!r}; send identity or zstd")
    import zstandard

    try:
        reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body))
        out = reader.read(limit + 1)
    except zstandard.ZstdError as exc:
        raise BadRequest(f"malformed zstd body: {exc}") from None
    if len(out) > limit:
        raise BadRequest(f"request body is larger than {limit} bytes after decompression")
    return out


_NP_OF_DTYPE = {1: np.float32, 2: np.int64, 3: np.int32}
_BFLOAT16 = 4


def _tensor(msg: Any, where: str, pad: int = 0) -> np.ndarray:
    """A proto ``Tensor`` (dense or sparse CSR, any public dtype) as a dense array;
    ``pad`` fills a sparse tensor's unlisted entries."""
    dtype = msg.dtype
    if dtype not in _NP_OF_DTYPE and dtype != _BFLOAT16:
        raise BadRequest(f"{where}: unsupported tensor dtype {dtype} (expected FLOAT32, INT64, INT32 or BFLOAT16)")
    np_dtype = np.dtype(np.uint16) if dtype == _BFLOAT16 else np.dtype(_NP_OF_DTYPE[dtype])

    def values_of(raw: bytes, what: str) -> np.ndarray:
        if len(raw) % np_dtype.itemsize:
            raise BadRequest(f"{where}: {what} has {len(raw)} bytes, not a multiple of {np_dtype.itemsize}")
        array = np.frombuffer(raw, dtype=np_dtype)
        if dtype == _BFLOAT16:
            array = (array.astype(np.uint32) << 16).view(np.float32)
        return array

    shape = [int(s) for s in msg.shape]
    if any(s < 0 for s in shape):
        raise BadRequest(f"{where}: negative dimension in shape {shape}")
    if msg.WhichOneof("encoding") == "sparse_csr":
        if len(shape) != 2:
            raise BadRequest(f"{where}: a sparse CSR tensor needs a 2-D shape, got {shape}")
        rows, cols = shape
        csr = msg.sparse_csr
        values = values_of(csr.values, "sparse values")
        for name, raw in (("crow_indices", csr.crow_indices), ("col_indices", csr.col_indices)):
            if len(raw) % 8:
                raise BadRequest(f"{where}: sparse {name} has {len(raw)} bytes, not a multiple of 8 (int64)")
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(csr.col_indices, dtype=np.int64)
        if len(crow) != rows + 1 or (len(crow) and crow[0] != 0):
            raise BadRequest(f"{where}: sparse crow_indices must have {rows + 1} entries starting at 0, got {len(crow)}")
        if np.any(np.diff(crow) < 0) or crow[-1] != len(col) or len(col) != len(values):
            raise BadRequest(
                f"{where}: inconsistent sparse CSR tensor ({len(values)} values, {len(col)} column indices, "
                f"last row pointer {int(crow[-1]) if len(crow) else None})"
            )
        if len(col) and (col.min() < 0 or col.max() >= cols):
            raise BadRequest(f"{where}: sparse column index out of range [0, {cols})")
        dense = np.full((rows, cols), pad, dtype=values.dtype)
        row_index = np.repeat(np.arange(rows), np.diff(crow))
        dense[row_index, col] = values
        return dense
    values = values_of(msg.dense, "dense data")
    if shape:
        if math.prod(shape) != len(values):
            raise BadRequest(f"{where}: shape {shape} needs {math.prod(shape)} values, got {len(values)}")
        return values.reshape(shape)
    return values


def _tokens_of_chunks(chunks: Sequence[Any], where: str) -> np.ndarray:
    parts = []
    for index, chunk in enumerate(chunks):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise BadRequest(
                f"{where}: model_input chunk {index} is {kind or 'empty'}; this server runs a text-only model "
                f"and accepts encoded_text chunks only"
            )
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise BadRequest(f"{where}: encoded_text chunk {index} has {len(raw)} bytes, not a multiple of 4 (int32)")
        parts.append(np.frombuffer(raw, dtype=np.int32))
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


def _config_of(legacy: Mapping[str, float], v2: Mapping[str, Any]) -> dict[str, float | str]:
    """``loss_fn_config``: v2 (numbers and strings) wins over the legacy float map."""
    config: dict[str, float | str] = {key: float(value) for key, value in legacy.items()}
    for key, value in v2.items():
        which = value.WhichOneof("value")
        if which == "number":
            config[key] = float(value.number)
        elif which == "text":
            config[key] = str(value.text)
    return config


def _check_provenance(datum: Any, n_inputs: int, inputs: Mapping[str, np.ndarray], where: str) -> None:
    """Refuse provenance spans that do not tile their field, as ``Datum.with_provenance``
    promises they do. The cookbook attaches spans to every RL datum whose samples carry a
    ``sequence_id``; only ``stable_reinforce`` reads them, and this service refuses that
    loss, so for every loss it serves a datum trains the same with or without them."""
    model_spans, target_spans = datum.model_input_spans, datum.loss_fn_input_spans
    if not model_spans and not target_spans:
        return
    if not model_spans or not target_spans:
        raise BadRequest(f"{where}: provenance comes as a pair: model_input_spans and loss_fn_input_spans, or neither")
    targets = inputs.get("target_tokens")
    for field, spans, expected in (
        ("model_input_spans", model_spans, n_inputs),
        ("loss_fn_input_spans", target_spans, None if targets is None else int(targets.shape[0])),
    ):
        covered = 0
        for span in spans:
            kind = span.WhichOneof("span")
            if kind is None:
                raise BadRequest(f"{where}: {field} has a span that is neither prompt_tokens nor sampled_tokens")
            covered += int(getattr(span, kind).length)
        if expected is not None and covered != expected:
            raise BadRequest(f"{where}: {field} cover {covered} positions but the field has {expected}; the runs must tile it exactly")


def decode_forward_backward(body: bytes) -> FwdBwdRequest:
    """Parse and check a protobuf ``ForwardBackwardRequest``."""
    pb = _pb()
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise BadRequest(f"malformed protobuf ForwardBackwardRequest: {exc}") from None
    if not message.model_id:
        raise BadRequest("ForwardBackwardRequest.model_id is empty (or the body is not a ForwardBackwardRequest)")
    data = []
    for index, datum in enumerate(message.data):
        where = f"datum {index}"
        tokens = _tokens_of_chunks(datum.model_input, where)
        inputs = {key: _tensor(tensor, f"{where} loss_fn_inputs[{key!r}]") for key, tensor in datum.loss_fn_inputs.items()}
        _check_provenance(datum, len(tokens), inputs, where)
        data.append(FwdBwdDatum(tokens, inputs))
    return FwdBwdRequest(
        model_id=message.model_id,
        seq_id=int(message.seq_id),
        loss_fn=message.loss_fn,
        loss_fn_config=_config_of(message.loss_fn_config, message.loss_fn_config_v2),
        forward_only=bool(message.forward_only),
        data=data,
    )


_JSON_DTYPES = {"float32": np.float32, "int64": np.int64}


def _json_tensor(value: Any, where: str, pad: int = 0) -> np.ndarray:
    if not isinstance(value, Mapping) or "data" not in value:
        raise BadRequest(f"{where}: expected a TensorData object with 'data' and 'dtype'")
    dtype = _JSON_DTYPES.get(value.get("dtype", "float32"))
    if dtype is None:
        raise BadRequest(f"{where}: dtype must be float32 or int64, got {value.get('dtype')!r}")
    try:
        with np.errstate(over="ignore"):
            values = np.asarray(value["data"], dtype=dtype).reshape(-1)
    except (TypeError, ValueError, OverflowError):
        raise BadRequest(f"{where}: data must be a flat list of {value.get('dtype', 'float32')} numbers") from None
    if dtype is np.float32 and not np.all(np.isfinite(values)):
        raise BadRequest(f"{where}: data holds NaN, an infinity or a number beyond float32")
    shape = value.get("shape")
    crow, col = value.get("sparse_crow_indices"), value.get("sparse_col_indices")
    if crow is not None or col is not None:
        pb = _pb()
        try:
            msg = pb.Tensor(dtype=1 if dtype is np.float32 else 2, shape=list(shape or []))
        except (TypeError, ValueError):
            raise BadRequest(f"{where}: shape must be a list of 64-bit integers, got {shape!r}") from None
        try:
            msg.sparse_csr.values = values.tobytes()
            msg.sparse_csr.crow_indices = np.asarray(crow or [], dtype=np.int64).tobytes()
            msg.sparse_csr.col_indices = np.asarray(col or [], dtype=np.int64).tobytes()
        except (TypeError, ValueError, OverflowError):
            raise BadRequest(f"{where}: sparse indices must be lists of 64-bit integers") from None
        return _tensor(msg, where, pad)
    if shape:
        try:
            return values.reshape([int(s) for s in shape])
        except (TypeError, ValueError, OverflowError):
            raise BadRequest(f"{where}: shape {shape} does not fit {len(values)} values") from None
    return values


_INTEGERS = {"type": "array", "items": {"type": "integer"}}
_TENSOR_DATA = {
    "type": "object",
    "properties": {
        "data": {"type": "array", "items": {"type": "number"}},
        "dtype": {"type": "string", "enum": sorted(_JSON_DTYPES)},
        "shape": _INTEGERS,
        "sparse_crow_indices": _INTEGERS,
        "sparse_col_indices": _INTEGERS,
    },
    "required": ["data"],
}
_DATUM = {
    "type": "object",
    "properties": {
        "model_input": {
            "type": "object",
            "properties": {
                "chunks": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"type": {"type": "string", "enum": ["encoded_text"]}, "tokens": _INTEGERS},
                        "required": ["tokens"],
                    },
                }
            },
            "required": ["chunks"],
        },
        "loss_fn_inputs": {"type": "object", "additionalProperties": _TENSOR_DATA},
    },
    "required": ["model_input"],
}
_FORWARD_BACKWARD_INPUT = {
    "type": "object",
    "properties": {
        "data": {"type": "array", "items": _DATUM},
        "loss_fn": {"type": "string"},
        "loss_fn_config": {"type": "object", "additionalProperties": {"type": ["number", "string"]}},
    },
    "required": ["data", "loss_fn"],
}
FORWARD_BACKWARD_JSON: dict[str, Any] = {
    "model_id": {"type": "string"},
    "seq_id": {"type": "integer", "minimum": 0, "maximum": SQL_INT_MAX},
    "forward_backward_input": _FORWARD_BACKWARD_INPUT,
    "forward_input": _FORWARD_BACKWARD_INPUT,
    "forward_only": {"type": "boolean"},
}
"""The JSON ``ForwardBackwardRequest`` that `decode_forward_backward_json` reads, field by
field, as JSON schemas (the routes' OpenAPI description): down to every number a client
sends, so a fuzzer built on the schema reaches each one's check."""


def forward_backward_ids(data: bytes, content_type: str) -> tuple[str, int] | None:
    """The model id and ``seq_id`` of a forward/backward body the decoders refused, when
    they can be read from it (a body refused for its datums still used its number)."""
    if "json" in content_type:
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            return None
        if not isinstance(body, Mapping):
            return None
        model_id, seq_id = body.get("model_id"), body.get("seq_id", 0)
    else:
        message = _pb().ForwardBackwardRequest()
        try:
            message.ParseFromString(data)
        except (DecodeError, RuntimeError, ValueError):
            return None
        model_id, seq_id = message.model_id, int(message.seq_id)
    if not isinstance(model_id, str) or not model_id or isinstance(seq_id, bool) or not isinstance(seq_id, int):
        return None
    return (model_id, seq_id) if 0 <= seq_id <= SQL_INT_MAX else None


def decode_forward_backward_json(body: Mapping[str, Any], forward_only: bool = False) -> FwdBwdRequest:
    """The SDK's JSON ``ForwardBackwardRequest`` (``forward_backward_input`` or ``forward_input``)."""
    if not isinstance(body, Mapping):
        raise BadRequest("forward_backward body must be a JSON object")
    fb_input = body.get("forward_backward_input") or body.get("forward_input")
    if not isinstance(fb_input, Mapping):
        raise BadRequest("forward_backward body needs a 'forward_backward_input' object")
    model_id, seq_id = body.get("model_id"), body.get("seq_id", 0)
    if not isinstance(model_id, str) or not model_id:
        raise BadRequest("forward_backward body needs a string 'model_id'")
    if isinstance(seq_id, bool) or not isinstance(seq_id, int) or not 0 <= seq_id <= SQL_INT_MAX:
        raise BadRequest(f"'seq_id' must be an integer from 0 to {SQL_INT_MAX}, got {seq_id!r}")
    raw_data = fb_input.get("data")
    if not isinstance(raw_data, list):
        raise BadRequest("forward_backward_input.data must be a list of datums")
    data = []
    for index, datum in enumerate(raw_data):
        where = f"datum {index}"
        if not isinstance(datum, Mapping):
            raise BadRequest(f"{where}: must be an object")
        model_input = datum.get("model_input")
        chunks = model_input.get("chunks") if isinstance(model_input, Mapping) else None
        if not isinstance(chunks, list):
            raise BadRequest(f"{where}: model_input must be an object whose chunks are a list")
        tokens: list[int] = []
        for c_index, chunk in enumerate(chunks):
            if not isinstance(chunk, Mapping) or chunk.get("type", "encoded_text") != "encoded_text":
                raise BadRequest(f"{where}: chunk {c_index} must be an encoded_text chunk (text-only model)")
            if not isinstance(chunk.get("tokens"), list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in chunk["tokens"]
            ):
                raise BadRequest(f"{where}: chunk {c_index} tokens must be a list of integers")
            tokens.extend(chunk["tokens"])
        raw_inputs = datum.get("loss_fn_inputs") or {}
        if not isinstance(raw_inputs, Mapping):
            raise BadRequest(f"{where}: loss_fn_inputs must be an object")
        inputs = {key: _json_tensor(value, f"{where} loss_fn_inputs[{key!r}]") for key, value in raw_inputs.items()}
        try:
            token_array = np.asarray(tokens, dtype=np.int64)
        except OverflowError:
            raise BadRequest(f"{where}: a token id does not fit a 64-bit integer") from None
        data.append(FwdBwdDatum(token_array, inputs))
    config = fb_input.get("loss_fn_config") or {}
    if not isinstance(config, Mapping) or not all(isinstance(v, (int, float, str)) and not isinstance(v, bool) for v in config.values()):
        raise BadRequest("loss_fn_config must map names to numbers or strings")
    return FwdBwdRequest(
        model_id=model_id,
        seq_id=seq_id,
        loss_fn=str(fb_input.get("loss_fn", "")),
        loss_fn_config={k: (v if isinstance(v, str) else float(v)) for k, v in config.items()},
        forward_only=bool(body.get("forward_only", forward_only)),
        data=data,
    )


def encode_forward_backward_output(outputs: Sequence[Mapping[str, np.ndarray]], metrics: Mapping[str, float]) -> bytes:
    """``ForwardBackwardOutput``: per-datum arrays batched into ArrayRecords.

    Datums whose fields share trailing shapes go into one record (usually all of
    them); a change of trailing shape starts a new record, which the SDK concatenates.
    """
    pb = _pb()
    message = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in metrics.items():
        message.metrics[key] = float(value)
    groups: list[list[Mapping[str, np.ndarray]]] = []
    signature = None
    for output in outputs:
        sig = tuple(sorted((name, tuple(np.shape(array)[1:])) for name, array in output.items()))
        if sig != signature or not groups:
            groups.append([])
            signature = sig
        groups[-1].append(output)
    for group in groups:
        record = message.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(group))
        for name in group[0]:
            arrays = [np.ascontiguousarray(output[name], dtype=np.float32) for output in group]
            offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
            offsets[1:] = np.cumsum([array.nbytes for array in arrays])
            field = record.fields[name]
            field.data = b"".join(array.tobytes() for array in arrays)
            field.offsets = offsets.tobytes()
            field.dtype = 1  # FLOAT32
            field.trailing_shape.extend(list(arrays[0].shape[1:]))
    return message.SerializeToString()


@attrs.frozen
class TargetPromptIds:
    """A ``SampleRequest``'s ``target_prompt_logprobs``: which ids to score where, and the
    layout the answer goes back in (the SDK promises "the same shape and layout")."""

    ids: np.ndarray
    """int64 [len(prompt) - 1, K]: row i scores prompt position i + 1; -1 (and every
    unlisted cell of a sparse request) asks for nothing."""
    crow: np.ndarray | None
    """The request's CSR row pointers, or None for a dense request."""
    col: np.ndarray | None

    def cells(self) -> tuple[list[int], list[int]]:
        """The prompt positions and ids of the cells that ask, in row-major order."""
        rows, cols = np.nonzero(self.ids >= 0)
        return (rows + 1).tolist(), self.ids[rows, cols].tolist()

    def answer(self, logprobs: Sequence[float]) -> Any:
        """The response ``Tensor``: float32 in the request's layout, ``logprobs`` (one per
        `cells` entry) where a cell asked, 0.0 elsewhere."""
        pb = _pb()
        values = np.zeros(self.ids.shape, dtype=np.float32)
        values[self.ids >= 0] = np.asarray(logprobs, dtype=np.float32)
        tensor = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=list(self.ids.shape))
        if self.crow is None or self.col is None:
            tensor.dense = values.tobytes()
            return tensor
        row_index = np.repeat(np.arange(self.ids.shape[0]), np.diff(self.crow))
        tensor.sparse_csr.values = values[row_index, self.col].tobytes()
        tensor.sparse_csr.crow_indices = self.crow.astype(np.int64).tobytes()
        tensor.sparse_csr.col_indices = self.col.astype(np.int64).tobytes()
        return tensor


def decode_target_prompt_ids(value: Any, prompt_length: int, vocab_size: int, max_cells: int) -> TargetPromptIds:
    """Read and check ``target_prompt_logprobs`` (JSON ``TensorData``) for a prompt of
    ``prompt_length`` tokens: int64, shape [prompt_length - 1, K] with at most
    ``max_cells`` cells, ids in the vocabulary or -1, at least one id."""
    where = "target_prompt_logprobs"
    if not isinstance(value, Mapping):
        raise BadRequest(f"{where} must be a TensorData object (data, dtype, shape)")
    if value.get("dtype") != "int64":
        raise BadRequest(f"{where} must hold int64 token ids, got dtype {value.get('dtype')!r}")
    shape = value.get("shape")
    rows = prompt_length - 1
    if not isinstance(shape, list) or len(shape) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) for n in shape):
        raise BadRequest(f"{where} must be 2-D, [len(prompt) - 1, K] = [{rows}, K], got shape {shape!r}")
    if shape[0] != rows or shape[1] < 1:
        raise BadRequest(f"{where} has shape {shape}; this prompt needs [len(prompt) - 1, K] = [{rows}, K] with K >= 1")
    if rows * shape[1] > max_cells:
        raise BadRequest(f"{where} has {rows * shape[1]} cells ({shape}); at most {max_cells} per request: lower K or split the prompt")
    ids = _json_tensor(value, where, pad=-1)
    bad = sorted({int(t) for t in ids[(ids < -1) | (ids >= vocab_size)]})
    if bad:
        raise BadRequest(f"{where} ids {bad[:5]} are neither -1 (no id) nor in the vocabulary [0, {vocab_size})")
    if not np.any(ids >= 0):
        raise BadRequest(f"{where} names no token id (every cell is -1); leave it out to ask for nothing")
    if value.get("sparse_crow_indices") is None and value.get("sparse_col_indices") is None:
        return TargetPromptIds(ids.astype(np.int64), None, None)
    # `_json_tensor` checked these against the shape and each other.
    crow = np.asarray(value.get("sparse_crow_indices") or [], dtype=np.int64)
    col = np.asarray(value.get("sparse_col_indices") or [], dtype=np.int64)
    return TargetPromptIds(ids.astype(np.int64), crow, col)


@attrs.frozen
class TopkRows:
    """A ``TopkLogprobs`` message's content: ``length`` positions of ``k`` entries; rows
    ``first`` to ``first + len(token_ids)`` are given (most likely first), every other
    row is the SDK's empty row (id 0, logprob ``MASK_LOGPROB``), which it reads as None."""

    length: int
    k: int
    first: int
    token_ids: Sequence[Sequence[int]]
    logprobs: Sequence[Sequence[float]]

    def write(self, message: Any) -> None:
        from tinker.types.topk_logprobs import MASK_LOGPROB

        ids = np.zeros((self.length, self.k), dtype=np.int32)
        values = np.full((self.length, self.k), MASK_LOGPROB, dtype=np.float32)
        if len(self.token_ids):
            end = self.first + len(self.token_ids)
            ids[self.first : end] = np.asarray(self.token_ids, dtype=np.int32).reshape(-1, self.k)
            values[self.first : end] = np.asarray(self.logprobs, dtype=np.float32).reshape(-1, self.k)
        message.token_ids = ids.tobytes()
        message.logprobs = values.tobytes()
        message.k = self.k
        message.length = self.length


def encode_sample_response(
    sequences: Sequence[tuple[Sequence[int], Sequence[float], str]],
    prompt_logprobs: Sequence[float | None] | None,
    *,
    sequence_topk: Sequence[TopkRows | None] | None = None,
    topk_prompt: TopkRows | None = None,
    target_prompt_logprobs: Any = None,
) -> bytes:
    """``SampleResponse``: tokens int32, logprobs float32, prompt logprobs with NaN for None;
    each sequence's ``topk_sampled_logprobs`` (``sequence_topk``, one per sequence),
    ``topk_prompt_logprobs`` and the ``target_prompt_logprobs`` tensor (`TargetPromptIds.answer`)
    when asked for."""
    pb = _pb()
    message = pb.SampleResponse()
    for index, (tokens, logprobs, stop_reason) in enumerate(sequences):
        sequence = message.sequences.add()
        sequence.stop_reason = pb.STOP_REASON_STOP if stop_reason == "stop" else pb.STOP_REASON_LENGTH
        sequence.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        sequence.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()
        topk = sequence_topk[index] if sequence_topk is not None else None
        if topk is not None:
            topk.write(sequence.topk_sampled_logprobs)
    if prompt_logprobs is not None:
        values = np.array([math.nan if v is None else v for v in prompt_logprobs], dtype=np.float32)
        message.prompt_logprobs = values.tobytes()
    if topk_prompt is not None:
        topk_prompt.write(message.topk_prompt_logprobs)
    if target_prompt_logprobs is not None:
        message.target_prompt_logprobs.CopyFrom(target_prompt_logprobs)
    message.prompt_cache_hit_tokens = 0
    return message.SerializeToString()
