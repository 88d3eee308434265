"""Reading an offline W&B run back, for tests and for looking at a run without a network.

An offline run is a folder (``offline-run-<time>-<id>``) whose ``run-<id>.wandb`` file is
W&B's transaction log: a LevelDB-style log (32 KiB blocks of checksummed chunks, after a
7-byte ``:W&B`` header) of `wandb.proto.wandb_internal_pb2.Record` messages, which is
what ``wandb sync`` uploads. W&B's Python package has no reader of its own for it any
more (its core service reads it), so this reads the chunks and decodes each record with
W&B's own message definitions.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

BLOCK_SIZE = 32 * 1024
FILE_HEADER = struct.Struct("<4sHB")
"""``:W&B``, the magic number 0xBEE1 and the format version."""
CHUNK_HEADER = struct.Struct("<IHB")
"""Checksum, length and type of one chunk."""
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


@attrs.frozen
class OfflineRun:
    """What one offline W&B run folder recorded."""

    run_id: str
    project: str
    name: str
    tags: tuple[str, ...]
    config: dict[str, Any]
    history: list[dict[str, Any]]
    """Each logged row, with W&B's ``_step``."""
    summary: dict[str, Any]


def _chunks(data: bytes) -> Iterator[bytes]:
    """The records of a LevelDB-style log, reassembled from their chunks."""
    position = FILE_HEADER.size
    pending = b""
    while position + CHUNK_HEADER.size <= len(data):
        left_in_block = BLOCK_SIZE - position % BLOCK_SIZE
        if left_in_block < CHUNK_HEADER.size:  # the block's tail is padding
            position += left_in_block
            continue
        _checksum, length, kind = CHUNK_HEADER.unpack_from(data, position)
        if kind == 0 and length == 0:
            break
        body = data[position + CHUNK_HEADER.size : position + CHUNK_HEADER.size + length]
        position += CHUNK_HEADER.size + length
        if kind == FULL:
            yield body
        elif kind == FIRST:
            pending = body
        elif kind == MIDDLE:
            pending += body
        elif kind == LAST:
            yield pending + body
            pending = b""


def _key(item: Any) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


def read_offline_run(run_dir: Path) -> OfflineRun:
    """Decode the ``.wandb`` file of one offline run folder."""
    from wandb.proto import wandb_internal_pb2

    (log,) = run_dir.glob("run-*.wandb")
    data = log.read_bytes()
    ident, _magic, _version = FILE_HEADER.unpack_from(data)
    if ident != b":W&B":
        raise ValueError(f"{log} is not a W&B transaction log")
    run: Any = None
    config: dict[str, Any] = {}
    history: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    for raw in _chunks(data):
        record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]  # wandb builds its protobuf classes at import and ships no stubs for them
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            config.update({_key(item): json.loads(item.value_json) for item in run.config.update})
        elif kind == "config":
            config.update({_key(item): json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            history.append({_key(item): json.loads(item.value_json) for item in record.history.item})
        elif kind == "summary":
            summary.update({_key(item): json.loads(item.value_json) for item in record.summary.update})
    if run is None:
        raise ValueError(f"{log} holds no run record")
    return OfflineRun(
        run_id=run.run_id,
        project=run.project,
        name=run.display_name,
        tags=tuple(run.tags),
        config=config,
        history=history,
        summary=summary,
    )


def read_offline_runs(wandb_dir: Path) -> list[OfflineRun]:
    """Every offline run under a ``wandb`` folder, oldest first (a resumed run is one
    folder per process, all with the same run id)."""
    return [read_offline_run(folder) for folder in sorted(wandb_dir.glob("offline-run-*"))]
