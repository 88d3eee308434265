"""Where weights live under the data directory, and how they are deleted safely.

``runs/<model>/<kind>/<name>.<hex>/`` holds named checkpoints (``training`` state,
``sampler`` exports or ``external`` exports to download, both HF directories) and ``runs/<model>/ephemeral/<sampler>/`` the
snapshots behind samplers made straight from a training model, and
``runs/<model>/autosave/`` the restart points a worker-group model saves itself. Every save writes a
fresh directory, so an engine cached for an older directory can never serve
overwritten weights. Directory names come from `safe_dirname`, so any id or name a
protocol allows maps to one portable, unique directory.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import shutil
from pathlib import Path

__all__ = ["CHECKPOINT_KINDS", "CheckpointFiles", "safe_dirname"]

log = logging.getLogger("nexrl_service")

CHECKPOINT_KINDS = ("training", "sampler", "external")
"""``training``: engine state to resume from; ``sampler``: exported weights to sample from;
``external``: the model to download (merged HF directory, LoRA adapter beside)."""


def safe_dirname(text: str) -> str:
    """A portable directory name for an id or checkpoint name, unique per input."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", text)[:80].strip("._") or "x"
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:10]
    return f"{readable}-{digest}"


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


class CheckpointFiles:
    """The checkpoint tree below ``root``; deletes nothing outside it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)

    def model_dir(self, model_id: str) -> Path:
        return self.root / safe_dirname(model_id)

    def new_checkpoint_dir(self, model_id: str, kind: str, name: str) -> Path:
        if kind not in CHECKPOINT_KINDS:
            raise ValueError(f"unknown checkpoint kind {kind!r}; expected one of {CHECKPOINT_KINDS}")
        return self.model_dir(model_id) / kind / f"{safe_dirname(name)}.{secrets.token_hex(4)}"

    def autosave_dir(self, model_id: str) -> Path:
        """Where a worker-group model saves its restart points (`nexrl_core.training.worker_groups`)."""
        return self.model_dir(model_id) / "autosave"

    def ephemeral_dir(self, model_id: str, sampler_id: str) -> Path:
        return self.model_dir(model_id) / "ephemeral" / safe_dirname(sampler_id)

    def link_copy(self, source: str | Path, model_id: str, kind: str, name: str) -> Path:
        """A new checkpoint directory of ``model_id`` with the files of ``source``, hard-linked
        so that no bytes are duplicated and either can be deleted alone (copied where the
        file system cannot link)."""
        target = self.new_checkpoint_dir(model_id, kind, name)
        shutil.copytree(source, target, copy_function=_link_or_copy)
        return target

    def remove(self, directory: str | Path | None) -> None:
        if not directory:
            return
        path = Path(directory)
        try:
            path.resolve().relative_to(self.root.resolve())
        except ValueError:
            log.warning("not deleting %s: outside the data directory", path)
            return
        shutil.rmtree(path, ignore_errors=True)

    @staticmethod
    def size_of(directory: Path) -> int:
        return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
