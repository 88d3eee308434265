"""HF weights export and download in nex-weaver's shapes, for the unmodified SDK's
``TrainingClient.export_weights()`` and ``ServiceClient.download_weights()``.

``export_weights()`` without a checkpoint posts ``/models/{id}/export-hf``: the job
runs behind everything submitted to the model so far and exports its current weights
through the runtime (`TrainingOps.export_external`, i.e. `Engine.export_hf`: the
merged HF directory, and for LoRA the adapter in PEFT layout under ``adapter/``). The
export is a runtime checkpoint of kind ``external`` at ``weaver://{model}/exports/{name}``;
the SDK knows it as an artifact whose id is derived from that path. Its kind follows
Weaver's rule: ``hf_model`` (the whole directory) for full fine-tuning and for LoRA
with ``merge_adapter``, ``hf_adapter`` (only ``adapter/``) for LoRA without.

``download_weights`` reads ``GET /artifacts/{id}/download``: one signed, expiring URL
per file on this service (the runtime's `SignedDownloads`, the same routes the Tinker
service serves) with each file's size and sha256, which the SDK verifies. A refused
URL makes the SDK fetch the descriptor again, so an expired one just renews.

Exporting a saved checkpoint (``/checkpoints/{id}/export``) and finding artifacts by
checkpoint are refused with a 400 that says what works instead: load the checkpoint
into a model and export that model's current weights.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from nexrl_core.training.model_export import ADAPTER_DIR
from nexrl_service.runtime import BadRequest, CheckpointRow, NotFound, Outcome, ServiceState
from nexrl_weaver.server import operations
from nexrl_weaver.server.bodies import flag, optional_int, optional_str
from nexrl_weaver.server.ids import checkpoint_id, checkpoint_path
from nexrl_weaver.server.training import WeaverTraining

__all__ = ["CHECKPOINT_EXPORT_REFUSAL", "WeaverArtifacts"]

HF_MODEL = "hf_model"
HF_ADAPTER = "hf_adapter"
KIND_KEY = "artifact_kind"
"""Where an export's checkpoint row keeps its artifact kind (``user_metadata``)."""
CHECKPOINT_EXPORT_REFUSAL = (
    "this service exports a model's current weights only: call TrainingClient.export_weights() without "
    "checkpoint= (to export a saved checkpoint, load_state() it into a model first), then download the "
    "returned artifact"
)
_HASH_CHUNK = 1 << 20


def _iso(timestamp: float | None) -> str | None:
    return None if timestamp is None else datetime.fromtimestamp(timestamp, tz=timezone.utc).isoformat()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(_HASH_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


class WeaverArtifacts:
    """Export jobs, artifact JSON and download descriptors."""

    def __init__(self, state: ServiceState, training: WeaverTraining) -> None:
        self.state = state
        self.training = training
        self._manifests: dict[str, dict[str, Any]] = {}
        """Storage directory → manifest, so a descriptor re-fetch hashes nothing again."""
        self._lock = threading.Lock()

    # --- export ---------------------------------------------------------------------------------

    def export_current(self, owner: str, model_id: str, body: dict[str, Any]) -> str:
        """Queue the export of the caller's live model's current weights; returns the request id."""
        model = self.training.model(owner, model_id)
        fmt = optional_str(body, "format") or "huggingface"
        if fmt != "huggingface":
            raise BadRequest(f"body.format must be 'huggingface' (the only export format), got {fmt!r}")
        merge = flag(body, "merge_adapter")
        ttl = optional_int(body, "ttl_seconds", minimum=1)
        if body.get("force") is not None:
            raise BadRequest("body.force applies to exporting a saved checkpoint; an export of the current weights is always fresh")
        is_lora = model.lora_rank > 0
        if merge and not is_lora:
            raise BadRequest(f"merge_adapter is for LoRA models; model {model_id!r} trains every weight, so leave it false")
        kind = HF_MODEL if merge or not is_lora else HF_ADAPTER

        def prepare() -> Callable[[], Outcome]:
            name = f"export-{int(time.time() * 1000)}"
            path = checkpoint_path(model.model_id, "external", name)

            def run() -> Outcome:
                self.training.ops.export_external(model, name, path, ttl, {KIND_KEY: kind})
                row = self.state.store.get_checkpoint(path)
                assert row is not None
                return operations.done(self.artifact_json(row))

            return run

        return self.training.ops.submit_after(owner, model, "ExportWeights", prepare)

    # --- artifacts ------------------------------------------------------------------------------

    def artifact_json(self, row: CheckpointRow) -> dict[str, Any]:
        """A completed artifact as the SDK's ``WeightsArtifact.from_payload`` reads it.
        It has no source checkpoint and no ``weaver://`` URI: download it by its id."""
        manifest = self._manifest(row)
        return {
            "id": checkpoint_id(row.path),
            "checkpoint_id": None,
            "model_id": row.model_id,
            "kind": _kind_of(row),
            "status": "completed",
            "uri": None,
            "size_bytes": sum(entry["size"] for entry in manifest["files"]),
            "manifest": manifest,
            "error": None,
            "ttl_seconds": None if row.expires_at is None else int(row.expires_at - row.created_at),
            "expires_at": _iso(row.expires_at),
            "created_at": _iso(row.created_at),
            "updated_at": _iso(row.created_at),
        }

    def get(self, owner: str, artifact_id: str) -> dict[str, Any]:
        return self.artifact_json(self._own_export(owner, artifact_id))

    def descriptor(self, owner: str, artifact_id: str, base_url: str) -> dict[str, Any]:
        """One signed URL per file of the caller's artifact, with size and sha256."""
        row = self._own_export(owner, artifact_id)
        manifest = self._manifest(row)
        signed = self.state.downloads.sign(_files_dir(row), base_url)
        expires = _iso(signed.expires_at)
        files = [
            {
                "name": entry["name"],
                "url": signed.urls[entry["name"]],
                "size": entry["size"],
                "sha256": entry["sha256"],
                "url_expires_at": expires,
            }
            for entry in manifest["files"]
        ]
        return {"artifact_id": artifact_id, "kind": _kind_of(row), "files": files, "expires_at": expires}

    def _own_export(self, owner: str, artifact_id: str) -> CheckpointRow:
        for model in self.state.store.models_of(owner):
            for row in self.state.store.checkpoints_of_model(model.model_id):
                if row.kind == "external" and checkpoint_id(row.path) == artifact_id:
                    return self.state.own_checkpoint(owner, row.path)
        raise NotFound(f"unknown artifact {artifact_id!r} (not exported by this API key, or expired); export it with export_weights()")

    def _manifest(self, row: CheckpointRow) -> dict[str, Any]:
        with self._lock:
            manifest = self._manifests.get(row.storage_dir)
        if manifest is None:
            root = _files_dir(row)
            files = [
                {"name": path.relative_to(root).as_posix(), "size": path.stat().st_size, "sha256": _sha256(path)}
                for path in sorted(p for p in root.rglob("*") if p.is_file())
            ]
            if not files:
                raise NotFound(f"artifact {checkpoint_id(row.path)!r} has no files")
            manifest = {"format": "huggingface", "files": files}
            with self._lock:
                self._manifests[row.storage_dir] = manifest
        return manifest


def _kind_of(row: CheckpointRow) -> str:
    return str((row.user_metadata or {}).get(KIND_KEY) or HF_MODEL)


def _files_dir(row: CheckpointRow) -> Path:
    """What an artifact's files are: the export, or for ``hf_adapter`` its adapter."""
    directory = Path(row.storage_dir)
    return directory / ADAPTER_DIR if _kind_of(row) == HF_ADAPTER else directory
