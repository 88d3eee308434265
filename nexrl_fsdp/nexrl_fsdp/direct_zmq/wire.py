"""The wire format of every direct-ZMQ message: a JSON header, then one raw frame per tensor.

Nothing is pickled: unpickling a frame from a socket runs whatever code the sender chose.
A message is a multipart ZMQ message whose first frame is a UTF-8 JSON object and whose
remaining frames are the bytes of the tensors it lists, in order::

    {"kind": "...", ..., "tensors": [{"name": "input_ids", "dtype": "int64", "shape": [8, 40]}, ...]}

Sending is zero-copy: each tensor frame is the tensor's own memory (a contiguous CPU
tensor is not copied; pyzmq keeps a reference until the bytes are on the wire). The
memory is exposed through numpy, which leaves the tensor's storage unresizable: send
a copy of a buffer something later resizes (an FSDP parameter held unsharded).
Receiving is zero-copy too: each tensor is built over the received frame's buffer, so
the decoded tensors are read-only views; clone one before writing into it.

Every message ends with one more frame, its MAC under the worker group's key
(`nexrl_fsdp.direct_zmq.group_key`: a nonce and a Poly1305 tag) over every other frame,
each preceded by its length (so no two ways of cutting the same bytes into frames share
a MAC). The sockets listen on
ports others may reach; `decode` checks the MAC before it reads anything else, so a
message from someone without the key (or one changed on the way) is refused whole
(`UnauthenticatedMessage`) and none of it is parsed, stored or run. The MAC proves who
sent a message, it hides nothing: see `group_key` for what that leaves to a VPN or TLS.
The MAC reads the tensors' memory in place (over the frames' buffers), so sending stays
zero-copy.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from nexrl_fsdp.direct_zmq.group_key import frames_mac, mac_matches

__all__ = ["DTYPES", "Message", "UnauthenticatedMessage", "WireError", "add_mac", "decode", "encode", "recv", "send", "verify_mac"]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
"""Tensor dtypes the wire carries, by the name the header uses."""

_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class WireError(ValueError):
    """A message that does not follow the wire format (says which part is wrong)."""


class UnauthenticatedMessage(WireError):
    """A message without a valid MAC under the group's key: its sender lacks the run's key
    (or it was changed on the way); it was dropped unread."""


@attrs.frozen
class Message:
    """A decoded message: the header's fields (``tensors`` removed) and the tensors by name."""

    header: dict[str, Any]
    tensors: dict[str, torch.Tensor]


def _tensor_frame(name: str, tensor: torch.Tensor) -> tuple[dict[str, Any], memoryview]:
    if not isinstance(tensor, torch.Tensor):
        raise WireError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    dtype = _DTYPE_NAMES.get(tensor.dtype)
    if dtype is None:
        raise WireError(f"tensor {name!r} has dtype {tensor.dtype}, which the wire does not carry; use one of {', '.join(DTYPES)}")
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    tensor = tensor.contiguous()
    # Viewed as bytes, every dtype (bfloat16 included, which numpy lacks) is one flat buffer.
    data = tensor.reshape(-1).view(torch.uint8).numpy().data if tensor.numel() else memoryview(b"")
    return {"name": name, "dtype": dtype, "shape": list(tensor.shape)}, data


def _buffer(frame: Any) -> memoryview:
    """The bytes of a frame without copying (a zmq.Frame, bytes or a memoryview)."""
    buffer = getattr(frame, "buffer", frame)
    return buffer if isinstance(buffer, memoryview) else memoryview(buffer)


def add_mac(frames: Sequence[Any], key: str) -> list[Any]:
    """``frames`` and, last, their MAC under ``key`` (the frames themselves are not copied)."""
    return [*frames, frames_mac([_buffer(frame) for frame in frames], key)]


def verify_mac(frames: Sequence[Any], key: str) -> Sequence[Any]:
    """The frames before the MAC, once the MAC is found to be theirs under ``key``.

    :raises UnauthenticatedMessage: when the last frame is not that MAC (no MAC at all,
        another key's, or a frame changed), before any other frame is read.
    """
    if len(frames) < 2:
        raise UnauthenticatedMessage(
            f"a message of {len(frames)} frame(s) lacks the run's key: every message is its header frame, its tensor "
            "frames, then a MAC frame made with the group's key"
        )
    body = frames[:-1]
    if not mac_matches([_buffer(frame) for frame in body], _buffer(frames[-1]), key):
        raise UnauthenticatedMessage(
            "the message lacks the run's key: its last frame is not the MAC of the others under the group's key "
            "(a sender without NEXRL_WORKER_KEY, another group's key, or a frame changed on the way); dropped unread"
        )
    return body


def encode(header: Mapping[str, Any], tensors: Mapping[str, torch.Tensor] | None = None, *, key: str) -> list[Any]:
    """The frames of one message: the JSON header, then each tensor's bytes (not copied),
    then their MAC under the group's ``key``.

    :raises WireError: for a tensor of a dtype the wire does not carry, or a header that
        is not JSON (or already has a ``tensors`` key).
    """
    if "tensors" in header:
        raise WireError("a message header may not have its own 'tensors' key; pass tensors separately")
    described, frames = [], []
    for name, tensor in (tensors or {}).items():
        description, frame = _tensor_frame(name, tensor)
        described.append(description)
        frames.append(frame)
    try:
        head = json.dumps({**header, "tensors": described}, allow_nan=True).encode()
    except (TypeError, ValueError) as error:
        raise WireError(f"a message header must be JSON: {error}") from None
    return add_mac([head, *frames], key)


def _tensor_over(buffer: memoryview, description: Any, index: int) -> tuple[str, torch.Tensor]:
    if not isinstance(description, dict) or not {"name", "dtype", "shape"} <= set(description):
        raise WireError(f"tensor description {index} must have name, dtype and shape, got {description!r}")
    name, dtype_name, shape = description["name"], description["dtype"], description["shape"]
    dtype = DTYPES.get(dtype_name)
    if dtype is None:
        raise WireError(f"tensor {name!r} has dtype {dtype_name!r}; the wire carries {', '.join(DTYPES)}")
    if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise WireError(f"tensor {name!r} has shape {shape!r}; a shape is a list of non-negative integers")
    count = 1
    for n in shape:
        count *= n
    expected = count * torch.empty((), dtype=dtype).element_size()
    if buffer.nbytes != expected:
        raise WireError(f"tensor {name!r} ({dtype_name} {shape}) needs {expected} bytes, its frame has {buffer.nbytes}")
    if expected == 0:
        return name, torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        # The frame is read-only; the tensor over it is documented as such (see the module).
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        flat = torch.frombuffer(buffer, dtype=torch.uint8)
    return name, flat.view(dtype).view(shape)


def decode(frames: Sequence[Any], *, key: str) -> Message:
    """A message from its frames; tensors are read-only views over the frames' buffers.

    :raises UnauthenticatedMessage: when its MAC is not the one the group's ``key`` makes
        (checked first: nothing of such a message is parsed).
    :raises WireError: naming what is wrong: a header that is not a JSON object, a frame
        count or size that does not match the header.
    """
    frames = verify_mac(frames, key)  # at least the header frame is left
    try:
        header = json.loads(bytes(_buffer(frames[0])))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise WireError(f"the header frame is not JSON: {error}") from None
    if not isinstance(header, dict):
        raise WireError(f"the header must be a JSON object, got {type(header).__name__}")
    described = header.pop("tensors", [])
    if not isinstance(described, list):
        raise WireError("the header's 'tensors' must be a list of {name, dtype, shape}")
    if len(described) != len(frames) - 1:
        raise WireError(f"the header lists {len(described)} tensors but {len(frames) - 1} tensor frames followed it")
    tensors = dict(_tensor_over(_buffer(frame), d, i) for i, (frame, d) in enumerate(zip(frames[1:], described)))
    if len(tensors) != len(described):
        raise WireError("the header lists a tensor name twice")
    return Message(header=header, tensors=tensors)


def send(
    socket: Any, header: Mapping[str, Any], tensors: Mapping[str, torch.Tensor] | None = None, *, key: str, prefix: Sequence[bytes] = ()
) -> None:
    """Send one message, MACed with the group's ``key``, on a pyzmq socket without copying
    the tensors; ``prefix`` frames (a ROUTER's peer identity, which ZMQ strips before
    the peer sees the message) go first, outside the MAC."""
    socket.send_multipart([*prefix, *encode(header, tensors, key=key)], copy=False)


def recv(socket: Any, *, key: str, prefix_frames: int = 0) -> tuple[list[bytes], Message]:
    """Receive one message from a pyzmq socket without copying its tensor frames; returns
    the first ``prefix_frames`` frames (a ROUTER's peer identity, outside the MAC) and
    the message.

    :raises UnauthenticatedMessage: for a message not MACed with the group's ``key``
        (it is consumed from the socket, and nothing of it is read).
    """
    frames = socket.recv_multipart(copy=False)
    prefix = [bytes(frame.buffer) for frame in frames[:prefix_frames]]
    return prefix, decode(frames[prefix_frames:], key=key)
