"""The calls that changed a group model since its restart point, kept on disk.

A `WorkerGroupEngine` keeps the forward_backward and optim_step calls answered since its
last restart point in memory and replays them on a new group when a rank dies. A service
killed as a whole loses that memory. Written here before each call is answered, the
calls let the restarted service rebuild the model as its client last saw it, so the
restart point (the whole training state, the expensive part) need not be saved after
every optimizer step: a journal entry is the step's datums, a few kilobytes.

Layout: ``<root>/<key>/<n>.safetensors``: one folder per restart point (``key``, a digest
of the point's path) and one file per call, holding the datums' tensors with the op and
its options as JSON metadata; no pickle. The folders of the current and of the previous
restart point are kept, since the owner records a new point only after the engine has
switched to it and may be killed in between. The files are not fsynced: they survive
``kill -9`` of the service, as its SQLite store does, not a power loss.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = ["GroupJournal", "ReplayCall"]

_OPS = ("forward_backward", "optim_step")


@attrs.frozen
class ReplayCall:
    """A call that changed the model since its restart point, replayed on a new group."""

    op: str = attrs.field(validator=attrs.validators.in_(_OPS))
    """``forward_backward`` or ``optim_step``."""
    datums: Mapping[str, torch.Tensor] | None = None
    """forward_backward's datums as the wire's flat tensors (`datum_tensors`)."""
    options: Mapping[str, Any] = attrs.field(factory=dict)


class GroupJournal:
    """The on-disk journal of one model's group, under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._current: Path | None = None
        self._previous: Path | None = None
        self._count = 0

    def _folder(self, point: Path | None) -> Path:
        if point is None:
            return self.root / "initial"
        return self.root / hashlib.sha256(str(Path(point).resolve()).encode()).hexdigest()[:16]

    def start(self, point: Path | None) -> None:
        """Begin an empty journal for a new restart point (None: the model's initial
        weights); journals older than the one it replaces are deleted."""
        folder = self._folder(point)
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        if self._current is not None and self._current != folder:
            self._previous = self._current
        keep = {folder, self._previous}
        for old in self.root.iterdir():
            if old not in keep:
                shutil.rmtree(old, ignore_errors=True)
        self._current, self._count = folder, 0

    def resume(self, point: Path | None) -> list[ReplayCall]:
        """The calls journaled after ``point``, in order; later calls are appended to them."""
        folder = self._folder(point)
        calls = [self._read(path) for path in sorted(folder.glob("*.safetensors"), key=lambda p: int(p.stem))]
        folder.mkdir(parents=True, exist_ok=True)
        self._current, self._count = folder, len(calls)
        return calls

    def append(self, call: ReplayCall) -> None:
        """Write ``call`` (before it is answered) after the current restart point's calls
        (the initial weights' when no point was started or resumed)."""
        if self._current is None:
            self.start(None)
        assert self._current is not None, "start() sets it"
        path = self._current / f"{self._count}.safetensors"
        tensors = {name: tensor.contiguous() for name, tensor in (call.datums or {}).items()}
        metadata = {"op": call.op, "options": json.dumps(dict(call.options)), "datums": json.dumps(call.datums is not None)}
        partial = path.with_suffix(".partial")
        save_file(tensors, str(partial), metadata=metadata)
        partial.replace(path)
        self._count += 1

    @staticmethod
    def _read(path: Path) -> ReplayCall:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata()
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        datums = tensors if json.loads(metadata["datums"]) else None
        return ReplayCall(metadata["op"], datums, json.loads(metadata["options"]))
