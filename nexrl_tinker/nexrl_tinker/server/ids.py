"""Identifier and path formats shared with the SDK (tinker-protocol.md §8).

* session ids: UUID4 strings;
* model (training run) ids: ``{session_id}:train:{model_seq_id}``; the SDK builds this
  string itself after ``create_training_client_from_state*``, so it is not a choice;
* sampler ids: ``{session_id}_{seq}_{8 hex}``;
* request ids: opaque strings (the SDK validates them as strings, not ints), made by
  the runtime's `new_request_id`;
* checkpoint paths: ``tinker://{model_id}/{weights|sampler_weights|external_weights}/{name}``,
  exactly three ``/``-separated segments after the scheme.
"""

from __future__ import annotations

import secrets
import uuid

from nexrl_service.runtime import CheckpointPathFormat

__all__ = [
    "PATHS",
    "checkpoint_path",
    "model_id_for",
    "new_sampler_id",
    "new_session_id",
    "parse_tinker_path",
]

PATHS = CheckpointPathFormat(
    "tinker://",
    {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"},
    example="tinker://<training_run_id>/weights/<name>",
)
"""``tinker://`` paths; their segments are the SDK's ``CheckpointType`` s."""
checkpoint_path = PATHS.path
parse_tinker_path = PATHS.parse


def new_session_id() -> str:
    return str(uuid.uuid4())


def model_id_for(session_id: str, model_seq_id: int) -> str:
    return f"{session_id}:train:{model_seq_id}"


def new_sampler_id(session_id: str, seq: int) -> str:
    return f"{session_id}_{seq}_{secrets.token_hex(4)}"
