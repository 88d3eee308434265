"""The direct-ZMQ wire: JSON header plus raw tensor frames, over real sockets, never pickle.
(Its MAC, the group's key on every message, is `test_group_keys`'.)"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq

from nexrl_fsdp.direct_zmq import wire
from nexrl_fsdp.direct_zmq.group_key import new_group_key

KEY = new_group_key()


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    """A PUSH socket connected to a PULL socket over TCP on 127.0.0.1."""
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = context.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    try:
        yield push, pull
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        context.term()


def _sample_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "float32": torch.randn(3, 5, generator=generator),
        "bfloat16": torch.randn(4, generator=generator).to(torch.bfloat16),
        "int64": torch.arange(12).view(3, 4),
        "bool": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 7),
        "strided": torch.arange(20, dtype=torch.float64).view(4, 5)[:, 1:3],
    }


def test_round_trip_over_tcp_keeps_every_dtype_shape_and_value(pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    push, pull = pair
    tensors = _sample_tensors()
    wire.send(push, {"kind": "update_actor", "op_id": "a1", "options": {"epochs": 2}}, tensors, key=KEY)
    _, message = wire.recv(pull, key=KEY)
    assert message.header == {"kind": "update_actor", "op_id": "a1", "options": {"epochs": 2}}
    assert list(message.tensors) == list(tensors)
    for name, tensor in tensors.items():
        got = message.tensors[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(got, tensor), name


def test_received_tensors_are_views_over_the_received_frames(pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    push, pull = pair
    payload = torch.arange(1 << 16, dtype=torch.float32)
    push.send_multipart(wire.encode({"kind": "x"}, {"payload": payload}, key=KEY), copy=False)
    frames = pull.recv_multipart(copy=False)
    message = wire.decode(frames, key=KEY)
    frame_address = np.frombuffer(frames[1].buffer, dtype=np.uint8).ctypes.data
    assert message.tensors["payload"].data_ptr() == frame_address
    assert torch.equal(message.tensors["payload"], payload)


def test_sending_does_not_copy_the_tensor() -> None:
    tensor = torch.arange(1000, dtype=torch.float32)
    frames = wire.encode({"kind": "x"}, {"t": tensor}, key=KEY)
    assert np.frombuffer(frames[1], dtype=np.uint8).ctypes.data == tensor.data_ptr()


def test_no_pickle_is_used_on_the_socket(pair: tuple[zmq.Socket, zmq.Socket], monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("pickle was used on the wire")

    for name in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    for name in ("send_pyobj", "recv_pyobj"):
        monkeypatch.setattr(zmq.Socket, name, refuse)
    push, pull = pair
    wire.send(push, {"kind": "x"}, _sample_tensors(), key=KEY)
    _, message = wire.recv(pull, key=KEY)
    assert torch.equal(message.tensors["int64"], torch.arange(12).view(3, 4))


class _TouchWhenUnpickled:
    """Unpickling this runs ``Path.touch`` on the marker: the proof that a decoder unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


def test_a_pickled_header_is_refused_and_never_unpickled(tmp_path: Path) -> None:
    """Whatever module could unpickle it (``pickle``, ``_pickle``, ``copyreg``...), a
    header that is a valid pickle is refused as not JSON and nothing in it runs, even
    from a sender with the key."""
    marker = tmp_path / "unpickled"
    for header in (pickle.dumps({"kind": "x"}), pickle.dumps({"kind": "x", "run": _TouchWhenUnpickled(marker)}, protocol=2)):
        with pytest.raises(wire.WireError, match="not JSON"):
            wire.decode(wire.add_mac([header], KEY), key=KEY)
    assert not marker.exists(), "the header was unpickled"


@pytest.mark.parametrize(
    ("frames", "complaint"),
    [
        ([b"\x80not json"], "not JSON"),
        ([b"[1, 2]"], "must be a JSON object"),
        ([b'{"tensors": [{"name": "a", "dtype": "float32", "shape": [2]}]}'], "lists 1 tensors but 0"),
        ([b'{"tensors": [{"name": "a", "dtype": "float32", "shape": [2]}]}', b"\x00" * 7], "needs 8 bytes"),
        ([b'{"tensors": [{"name": "a", "dtype": "object", "shape": [1]}]}', b"\x00"], "dtype 'object'"),
        ([b'{"tensors": [{"name": "a", "dtype": "int8", "shape": [-1]}]}', b"\x00"], "non-negative integers"),
        ([b'{"tensors": [{"name": "a"}]}', b""], "must have name, dtype and shape"),
    ],
)
def test_malformed_messages_are_refused_with_what_is_wrong(frames: list[bytes], complaint: str) -> None:
    """Sent with the key: the MAC is right, the message is not."""
    with pytest.raises(wire.WireError, match=complaint):
        wire.decode(wire.add_mac(frames, KEY), key=KEY)


def test_unsupported_tensor_dtype_is_refused_when_encoding() -> None:
    with pytest.raises(wire.WireError, match="complex64"):
        wire.encode({"kind": "x"}, {"z": torch.zeros(2, dtype=torch.complex64)}, key=KEY)
