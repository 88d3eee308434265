"""Training runs and their checkpoints as the SDK's RestClient sees them: listings,
deletion, publishing and time-to-live.

The cookbook reads ``GET training_runs/{id}`` on resume (``user_metadata.renderer_name``)
and deletes rolling checkpoints with ``DELETE training_runs/{id}/checkpoints/{kind}/{name}``;
its ``weights.download`` renews the time-to-live of the export it downloads
(``PUT .../ttl``). A published checkpoint can be read by any API key (sampled from,
loaded, copied), and a checkpoint past its expiry is gone at once (`ServiceState.own_checkpoint`).
``external_weights_urls`` signs one URL per file of an exported model, served by this
service (the runtime's `SignedDownloads`), which ``tinker checkpoint download`` and
NexRL's holder fetch with a plain GET.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any

from nexrl_service.runtime import BadRequest, CheckpointRow, ModelRow, NotFound, Page, ServiceState
from nexrl_tinker.server.ids import parse_tinker_path
from nexrl_tinker.server.sessions import str_dict

__all__ = ["TTL_MAX_S", "TTL_MIN_S", "RunService", "check_ttl"]

TTL_MIN_S = 3600
TTL_MAX_S = 10 * 365 * 24 * 3600
"""A time-to-live set on an existing checkpoint or a copy: 1 hour to 10 years, as the SDK documents."""


def check_ttl(ttl_seconds: object) -> int | None:
    """``ttl_seconds`` when it is None (no expiry) or within the bounds, else `BadRequest`."""
    if ttl_seconds is None:
        return None
    if not isinstance(ttl_seconds, int) or isinstance(ttl_seconds, bool) or not TTL_MIN_S <= ttl_seconds <= TTL_MAX_S:
        raise BadRequest(
            f"ttl_seconds must be an integer between {TTL_MIN_S} (1 hour) and {TTL_MAX_S} (10 years), or null "
            f"for no expiry; got {ttl_seconds!r}"
        )
    return ttl_seconds


def _live(row: CheckpointRow, now: float) -> bool:
    return row.expires_at is None or row.expires_at > now


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
        "public": bool(row.public),
        "user_metadata": str_dict(row.user_metadata),
        "expires_at": _iso(row.expires_at),
    }


class RunService:
    def __init__(self, state: ServiceState) -> None:
        self.state = state

    def _live_checkpoints(self, model_id: str) -> list[CheckpointRow]:
        now = time.time()
        return [c for c in self.state.store.checkpoints_of_model(model_id) if _live(c, now)]

    def _run_json(self, model: ModelRow) -> dict[str, Any]:
        checkpoints = self._live_checkpoints(model.model_id)
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

    def list(self, owner: str, page: Page, project_id: str | None = None) -> dict[str, Any]:
        """The caller's training runs, oldest first; with ``project_id``, those whose session
        is in that project (`SessionService.assign_project`)."""
        models = self.state.store.models_of(owner)
        if project_id is not None:
            in_project = {s.session_id for s in self.state.store.sessions_of(owner) if s.project_id == project_id}
            models = [m for m in models if m.session_id in in_project]
        rows = models[page.offset : page.offset + page.limit]
        return {"training_runs": [self._run_json(m) for m in rows], "cursor": page.cursor(len(models))}

    def checkpoints(self, owner: str, training_run_id: str) -> dict[str, Any]:
        model = self.state.own_model(owner, training_run_id)
        return {"checkpoints": [checkpoint_json(r) for r in self._live_checkpoints(model.model_id)], "cursor": None}

    def user_checkpoints(self, owner: str, page: Page) -> dict[str, Any]:
        rows = [c for m in self.state.store.models_of(owner) for c in self._live_checkpoints(m.model_id)]
        rows.sort(key=lambda r: (r.created_at, r.path), reverse=True)
        return {
            "checkpoints": [checkpoint_json(r) for r in rows[page.offset : page.offset + page.limit]],
            "cursor": page.cursor(len(rows)),
        }

    def _own(self, owner: str, training_run_id: str, checkpoint_id: str) -> CheckpointRow:
        model = self.state.own_model(owner, training_run_id)
        return self.state.own_checkpoint(owner, parse_tinker_path(f"tinker://{model.model_id}/{checkpoint_id}").path)

    def publish(self, owner: str, training_run_id: str, checkpoint_id: str, public: bool) -> dict[str, Any]:
        """Publish (``public``) or unpublish the caller's checkpoint.

        Hosted Tinker answers 409 when it already is so, which SDK 0.38 retries for up to
        two hours; this service answers 400, so the call fails at once with the reason.
        """
        row = self._own(owner, training_run_id, checkpoint_id)
        if row.public == public:
            if public:
                raise BadRequest(f"checkpoint {row.path!r} is already public; unpublish_checkpoint_from_tinker_path makes it private")
            raise BadRequest(f"checkpoint {row.path!r} is already private; publish_checkpoint_from_tinker_path makes it public")
        return self._answer(row.path, self.state.store.update_checkpoint(row.path, public=public))

    def set_ttl(self, owner: str, training_run_id: str, checkpoint_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """Expire the checkpoint ``ttl_seconds`` from now, or never (``null``)."""
        if "ttl_seconds" not in body:
            raise BadRequest('the body must be {"ttl_seconds": <seconds, 3600 to 10 years> or null}')
        ttl = check_ttl(body["ttl_seconds"])
        row = self._own(owner, training_run_id, checkpoint_id)
        return self._answer(row.path, self.state.store.update_checkpoint(row.path, expires_at=None if ttl is None else time.time() + ttl))

    @staticmethod
    def _answer(path: str, updated: CheckpointRow | None) -> dict[str, Any]:
        if updated is None:  # deleted between the lookup and the update
            raise NotFound(f"unknown checkpoint {path!r}")
        return checkpoint_json(updated)

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

    def weights_info(self, owner: str, tinker_path: object) -> dict[str, Any]:
        """``tinker_path`` is the request's, any JSON value: anything but a string is refused."""
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
