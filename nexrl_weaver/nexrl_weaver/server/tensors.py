"""Tensors on the Weaver wire: inline JSON, and the ``http-binary`` tensor packs.

Under the default transport a tensor is a JSON list, or ``{"data", "dtype",
"shape"?}`` (the SDK's ``TensorData``). Under ``http-binary`` a forward or
forward-backward request is a multipart body of two parts, a JSON ``manifest``
(``{"version": 1, "request": ..., "tensor_pack": {size_bytes, sha256, codec,
decoded_size_bytes}}``) and the ``tensor_pack`` itself: raw little-endian tensors
concatenated, one zstd frame unless ``raw``. Inside the request a tensor is then a
``{"$tensor": {format, codec, dtype, shape, offset, size_bytes}}`` slice of the pack.
Results go back the same way: `ResultPack` collects output tensors into a pack the
SDK downloads from ``GET /operations/{id}/tensor-pack``.

Every malformed input raises `BadRequest` naming what is wrong.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from nexrl_service.runtime import BadRequest

__all__ = ["ResultPack", "TensorPack", "parse_multipart", "to_array"]

TENSOR_KEY = "$tensor"
DTYPES = {"int64": np.int64, "int32": np.int32, "float32": np.float32, "float64": np.float64}
CODECS = ("raw", "zstd")


class TensorPack:
    """The decoded bytes of a request's tensor pack, sliced by ``$tensor`` descriptors."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def slice(self, descriptor: Any, where: str) -> np.ndarray:
        if not isinstance(descriptor, Mapping):
            raise BadRequest(f"{where}: $tensor must be an object descriptor")
        if descriptor.get("format", "raw-tensor") != "raw-tensor" or descriptor.get("codec", "raw") != "raw":
            raise BadRequest(f"{where}: $tensor must use format raw-tensor and codec raw")
        dtype = DTYPES.get(descriptor.get("dtype"))  # type: ignore[arg-type]
        if dtype is None:
            raise BadRequest(f"{where}: $tensor dtype {descriptor.get('dtype')!r} is not one of {sorted(DTYPES)}")
        shape = descriptor.get("shape")
        offset, size = descriptor.get("offset", 0), descriptor.get("size_bytes")
        if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise BadRequest(f"{where}: $tensor shape must be a list of non-negative integers")
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (offset, size)):
            raise BadRequest(f"{where}: $tensor offset and size_bytes must be non-negative integers")
        if math.prod(shape) * np.dtype(dtype).itemsize != size:
            raise BadRequest(f"{where}: $tensor size_bytes {size} does not match shape {shape} and dtype")
        if offset + size > len(self.data):
            raise BadRequest(f"{where}: $tensor slice [{offset}, {offset + size}) exceeds the {len(self.data)}-byte tensor pack")
        return np.frombuffer(self.data, dtype=np.dtype(dtype).newbyteorder("<"), count=math.prod(shape), offset=offset).reshape(shape)


def to_array(value: Any, where: str, pack: TensorPack | None) -> np.ndarray:
    """A tensor in any of the wire forms as a numpy array."""
    if isinstance(value, Mapping):
        if TENSOR_KEY in value:
            if pack is None:
                raise BadRequest(f"{where}: a $tensor reference needs the http-binary tensor pack")
            return pack.slice(value[TENSOR_KEY], where)
        if "data" not in value:
            raise BadRequest(f"{where}: a tensor object needs 'data' (and optionally 'dtype', 'shape')")
        dtype = value.get("dtype")
        if dtype is not None and dtype not in DTYPES:
            raise BadRequest(f"{where}: dtype {dtype!r} is not one of {sorted(DTYPES)}")
        array = _numeric(value["data"], where, DTYPES.get(dtype) if dtype else None)
        shape = value.get("shape")
        if shape is not None:
            try:
                array = array.reshape(shape)
            except (TypeError, ValueError):
                raise BadRequest(f"{where}: data of {array.size} values does not fit shape {shape}") from None
        return array
    return _numeric(value, where, None)


def _numeric(value: Any, where: str, dtype: Any) -> np.ndarray:
    try:
        array = np.asarray(value, dtype=dtype)
    except (TypeError, ValueError):
        raise BadRequest(f"{where}: expected a list of numbers") from None
    if array.dtype.kind not in "iuf" or array.ndim == 0:
        raise BadRequest(f"{where}: expected a list of numbers, got {type(value).__name__}")
    if array.dtype.kind == "f" and not np.all(np.isfinite(array)):
        raise BadRequest(f"{where}: contains NaN or infinite values")
    return array


def _boundary(content_type: str) -> bytes:
    for part in content_type.split(";")[1:]:
        key, _, value = part.strip().partition("=")
        if key.lower() == "boundary" and value:
            return value.strip('"').encode("ascii", "replace")
    raise BadRequest("multipart body without a boundary in its Content-Type")


def _parts(body: bytes, boundary: bytes) -> dict[str, bytes]:
    marker = b"--" + boundary
    parts: dict[str, bytes] = {}
    for chunk in body.split(marker)[1:]:
        if chunk.startswith(b"--"):
            break
        head, sep, content = chunk.partition(b"\r\n\r\n")
        if not sep:
            raise BadRequest("malformed multipart body: a part has no header/body separator")
        if content.endswith(b"\r\n"):
            content = content[:-2]
        name = None
        for line in head.decode("latin-1").split("\r\n"):
            if line.lower().startswith("content-disposition"):
                for item in line.split(";"):
                    key, _, value = item.strip().partition("=")
                    if key == "name":
                        name = value.strip('"')
        if name:
            parts[name] = content
    return parts


def parse_multipart(body: bytes, content_type: str, max_bytes: int) -> tuple[dict[str, Any], TensorPack]:
    """The JSON request and the decoded tensor pack of an ``http-binary`` submission."""
    parts = _parts(body, _boundary(content_type))
    missing = [name for name in ("manifest", "tensor_pack") if name not in parts]
    if missing:
        raise BadRequest(f"multipart body lacks the part(s) {missing}; expected 'manifest' and 'tensor_pack'")
    try:
        manifest = json.loads(parts["manifest"])
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"malformed manifest JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("version") != 1:
        raise BadRequest("the multipart manifest must be an object with version 1")
    request, meta = manifest.get("request"), manifest.get("tensor_pack")
    if not isinstance(request, dict) or not isinstance(meta, dict):
        raise BadRequest("the multipart manifest needs a 'request' object and a 'tensor_pack' object")
    wire = parts["tensor_pack"]
    codec = meta.get("codec", "raw")
    if codec not in CODECS:
        raise BadRequest(f"tensor_pack.codec {codec!r} is not one of {list(CODECS)}")
    if meta.get("size_bytes") != len(wire):
        raise BadRequest(f"tensor_pack.size_bytes {meta.get('size_bytes')!r} but the part has {len(wire)} bytes")
    if hashlib.sha256(wire).hexdigest() != str(meta.get("sha256", "")).lower():
        raise BadRequest("tensor_pack.sha256 does not match the tensor pack part")
    decoded_size = meta.get("decoded_size_bytes", len(wire))
    if not isinstance(decoded_size, int) or not 0 <= decoded_size <= max_bytes:
        raise BadRequest(f"tensor_pack.decoded_size_bytes must be an integer between 0 and {max_bytes}")
    if codec == "zstd":
        import zstandard

        try:
            data = zstandard.ZstdDecompressor().decompress(wire, max_output_size=decoded_size)
        except zstandard.ZstdError as exc:
            raise BadRequest(f"the zstd tensor pack does not decode: {exc}") from None
    else:
        data = wire
    if len(data) != decoded_size:
        raise BadRequest(f"the tensor pack decodes to {len(data)} bytes, not decoded_size_bytes={decoded_size}")
    return request, TensorPack(data)


class ResultPack:
    """Output tensors of one operation, for a client that sent ``http-binary``."""

    def __init__(self, codec: str) -> None:
        self.codec = codec if codec in CODECS else "raw"
        self._chunks: list[bytes] = []
        self._size = 0

    def put(self, array: np.ndarray, dtype: str = "float32") -> dict[str, Any]:
        data = np.ascontiguousarray(array, dtype=np.dtype(DTYPES[dtype]).newbyteorder("<")).tobytes()
        descriptor = {
            "format": "raw-tensor",
            "codec": "raw",
            "dtype": dtype,
            "shape": list(np.shape(array)),
            "offset": self._size,
            "size_bytes": len(data),
        }
        self._chunks.append(data)
        self._size += len(data)
        return {TENSOR_KEY: descriptor}

    def finish(self) -> tuple[dict[str, Any], bytes]:
        """The ``tensor_pack`` metadata for the response, and the bytes to serve."""
        raw = b"".join(self._chunks)
        if self.codec == "zstd":
            import zstandard

            wire = zstandard.ZstdCompressor(level=3).compress(raw)
        else:
            wire = raw
        meta = {
            "size_bytes": len(wire),
            "sha256": hashlib.sha256(wire).hexdigest(),
            "codec": self.codec,
            "decoded_size_bytes": len(raw),
        }
        return meta, wire
