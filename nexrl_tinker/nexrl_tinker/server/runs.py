"""Read-and-delete views over training runs and checkpoints (the SDK's RestClient).

The cookbook reads ``GET training_runs/{id}`` on resume (``user_metadata.renderer_name``)
and deletes rolling checkpoints with ``DELETE training_runs/{id}/checkpoints/{kind}/{name}``.
``external_weights_urls`` signs one URL per file of an exported model, served by this
service (the runtime's `SignedDownloads`), which ``tinker checkpoint download`` and
NexRL's holder fetch with a plain GET.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from nexrl_service.errors import BadRequest, NotFound
from nexrl_service.state import ServiceState
from nexrl_service.store import CheckpointRow, ModelRow
from nexrl_tinker.server.ids import parse_tinker_path
from nexrl_tinker.server.sessions import str_dict

__all__ = ["RunService"]


def _iso(timestamp: float | None) -> str | None:
    if timestamp is None:
        return None
    return datetime.fromtimestamp(timestamp, tz=timezone.utc).isoformat()


def checkpoint_json(row: CheckpointRow) -> dict[str, Any]:
    return {
        "checkpoint_id": parse_tinker_path(row.path).below_model,
        "checkpoint_type": row.kind,
        "time": _iso(row.created_at),
        "tinker_path": row.path,
        "size_bytes": row.size_bytes,
        "public": False,
        "user_metadata": str_dict(row.user_metadata),
        "expires_at": _iso(row.expires_at),
    }


class RunService:
    def __init__(self, state: ServiceState) -> None:
        self.state = state

    def _run_json(self, model: ModelRow) -> dict[str, Any]:
        checkpoints = self.state.store.checkpoints_of_model(model.model_id)
        training = [c for c in checkpoints if c.kind == "training"]
        sampler = [c for c in checkpoints if c.kind == "sampler"]
        return {
            "training_run_id": model.model_id,
            "base_model": self.state.base.name,
            "model_owner": model.owner,
            "is_lora": model.lora_rank > 0,
            "corrupted": model.status == "failed",
            "lora_rank": model.lora_rank if model.lora_rank > 0 else None,
            "last_request_time": _iso(model.last_request_time),
            "last_checkpoint": checkpoint_json(training[-1]) if training else None,
            "last_sampler_checkpoint": checkpoint_json(sampler[-1]) if sampler else None,
            "user_metadata": str_dict(model.user_metadata),
        }

    def get(self, owner: str, training_run_id: str) -> dict[str, Any]:
        return self._run_json(self.state.own_model(owner, training_run_id))

    def list(self, owner: str, limit: int, offset: int) -> dict[str, Any]:
        models = self.state.store.models_of(owner)
        page = models[offset : offset + limit]
        return {
            "training_runs": [self._run_json(m) for m in page],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(models)},
        }

    def checkpoints(self, owner: str, training_run_id: str) -> dict[str, Any]:
        model = self.state.own_model(owner, training_run_id)
        rows = self.state.store.checkpoints_of_model(model.model_id)
        return {"checkpoints": [checkpoint_json(r) for r in rows], "cursor": None}

    def user_checkpoints(self, owner: str, limit: int, offset: int) -> dict[str, Any]:
        rows = [c for m in self.state.store.models_of(owner) for c in self.state.store.checkpoints_of_model(m.model_id)]
        rows.sort(key=lambda r: r.created_at, reverse=True)
        return {
            "checkpoints": [checkpoint_json(r) for r in rows[offset : offset + limit]],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(rows)},
        }

    def delete_checkpoint(self, owner: str, training_run_id: str, checkpoint_id: str) -> dict[str, Any]:
        model = self.state.own_model(owner, training_run_id)
        path = f"tinker://{model.model_id}/{checkpoint_id}"
        parse_tinker_path(path)
        row = self.state.store.get_checkpoint(path)
        if row is None:
            raise NotFound(f"unknown checkpoint {path!r}")
        self.state.store.delete_checkpoint(path)
        self.state.forget_checkpoint_files(row)
        return {"deleted": path}

    def external_weights_urls(self, owner: str, training_run_id: str, checkpoint_id: str, base_url: str) -> dict[str, Any]:
        """Signed download URLs, one per file, of the caller's external-weights checkpoint."""
        model = self.state.own_model(owner, training_run_id)
        parsed = parse_tinker_path(f"tinker://{model.model_id}/{checkpoint_id}")
        if parsed.kind != "external":
            raise BadRequest(
                f"only external weights can be downloaded, not {parsed.path!r}; export them with "
                f"save_weights_external (tinker://<run>/external_weights/<name>)"
            )
        checkpoint = self.state.own_checkpoint(owner, parsed.path)
        signed = self.state.downloads.sign(checkpoint.storage_dir, base_url)
        return {"urls": signed.urls, "expires": _iso(signed.expires_at)}

    def weights_info(self, owner: str, tinker_path: str) -> dict[str, Any]:
        if not isinstance(tinker_path, str):
            raise BadRequest("weights_info needs a 'tinker_path' string")
        parsed = parse_tinker_path(tinker_path)
        self.state.own_checkpoint(owner, parsed.path)
        model = self.state.own_model(owner, parsed.model_id)
        return {
            "base_model": self.state.base.name,
            "optimizer_config": {"type": "adamw"},
            "is_lora": model.lora_rank > 0,
            "lora_rank": model.lora_rank if model.lora_rank > 0 else None,
            "train_unembed": model.train_unembed,
            "train_mlp": model.train_mlp,
            "train_attn": model.train_attn,
        }
