"""``copy_weights``: a checkpoint copied into a new training run (``POST /api/v1/copy_weights``).

As on hosted Tinker, the copy keeps the source's kind and name, belongs to a new
training run that cannot be trained on, and shares the source's storage: its files are
hard links to the source's (no bytes duplicated, either deletable alone). The run goes
into a new session in ``destination_project_id``, or into the caller's session named by
``session_id`` at slot ``model_seq_id``. The source may be the caller's or a published
checkpoint. The SDK sends one ``X-Idempotency-Key`` across its retries; a retried request
answers the copy the first one made.
"""

from __future__ import annotations

import time
from typing import Any

from nexrl_service.runtime import COPY_STATUS, BadRequest, CheckpointRow, ModelRow, ServiceState, SessionRow, Sessions
from nexrl_tinker.server.ids import checkpoint_path, model_id_for, new_session_id, parse_tinker_path
from nexrl_tinker.server.runs import check_ttl
from nexrl_tinker.server.schemas import CopyWeightsBody
from nexrl_tinker.server.sessions import PROJECT_ID_MAX

__all__ = ["CopyService"]

IDEMPOTENCY_KEY_MAX = 128
"""The width of the store's ``copied_by`` column."""


class CopyService:
    def __init__(self, state: ServiceState) -> None:
        self.state = state
        self.sessions = Sessions(state)

    def copy(self, owner: str, body: CopyWeightsBody, idempotency_key: str | None, access_token: str | None) -> dict[str, Any]:
        """``{"tinker_path": <the copy>}``.

        :raises BadRequest: for a weights access token (this service issues none), a
            ttl out of bounds, no destination, or a taken ``model_seq_id``.
        """
        if body.weights_access_token is not None or access_token is not None:
            raise BadRequest(
                "weights_access_token: this service issues no access tokens; the owner of the weights can "
                "publish them (publish_checkpoint_from_tinker_path) so that any API key may copy them"
            )
        if idempotency_key is not None and len(idempotency_key) > IDEMPOTENCY_KEY_MAX:
            raise BadRequest(f"X-Idempotency-Key is longer than {IDEMPOTENCY_KEY_MAX} characters")
        if idempotency_key:
            earlier = self.state.store.checkpoint_copied_by(owner, idempotency_key)
            if earlier is not None:
                return {"tinker_path": earlier.path}
        ttl = check_ttl(body.ttl_seconds)
        source = self.state.own_checkpoint(owner, parse_tinker_path(body.source_path).path, public_ok=True)
        source_model = self.state.store.get_model(source.model_id)
        if source_model is None:
            raise BadRequest(f"the training run that saved {source.path!r} no longer exists")
        session, seq = self._destination(owner, body)
        model_id = model_id_for(session.session_id, seq)
        now = time.time()
        added = self.state.store.add_model(
            ModelRow(
                model_id=model_id,
                session_id=session.session_id,
                model_seq_id=seq,
                owner=owner,
                base_model=source_model.base_model,
                lora_rank=source_model.lora_rank,
                lora_alpha=source_model.lora_alpha,
                lora_seed=source_model.lora_seed,
                train_mlp=source_model.train_mlp,
                train_attn=source_model.train_attn,
                train_unembed=source_model.train_unembed,
                user_metadata=source_model.user_metadata,
                created_at=now,
                last_request_time=now,
                create_request_id=f"copy:{idempotency_key or model_id}"[:64],
                status=COPY_STATUS,
                last_seq=0,
            )
        )
        if not added:
            raise BadRequest(f"model_seq_id {seq} is already used in session {session.session_id!r}; pick a free slot")
        directory = self.state.files.link_copy(source.storage_dir, model_id, source.kind, source.name)
        path = checkpoint_path(model_id, source.kind, source.name)
        self.state.store.put_checkpoint(
            CheckpointRow(
                path=path,
                model_id=model_id,
                owner=owner,
                kind=source.kind,
                name=source.name,
                storage_dir=str(directory),
                has_optimizer=source.has_optimizer,
                created_at=now,
                expires_at=None if ttl is None else now + ttl,
                size_bytes=source.size_bytes,
                user_metadata=source.user_metadata,
                public=False,
                copied_by=idempotency_key or None,
            )
        )
        return {"tinker_path": path}

    def _destination(self, owner: str, body: CopyWeightsBody) -> tuple[SessionRow, int]:
        """The session the copy's training run goes into, and the run's slot in it (0 in a new one)."""
        if body.session_id is not None:
            if body.model_seq_id is None:
                raise BadRequest("copy_weights with session_id also needs model_seq_id (the training run's slot in it)")
            return self.state.own_session(owner, body.session_id, active=True), body.model_seq_id
        project = body.destination_project_id
        if not project:
            raise BadRequest("copy_weights needs destination_project_id, or session_id with model_seq_id")
        if len(project) > PROJECT_ID_MAX:
            raise BadRequest(f"destination_project_id is longer than {PROJECT_ID_MAX} characters")
        session = self.sessions.create(owner, new_session_id(), project_id=project, display_name=f"copy of {body.source_path}"[:256])
        # No client holds this session: it is finished at once, and the copy's run with it.
        self.state.store.finish_session(session.session_id, "copy_weights")
        return session, 0
