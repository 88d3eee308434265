"""Identifier and path formats the nex-weaver SDK expects.

* session, model, sampling-session and checkpoint ids are UUID strings (the SDK
  validates checkpoint ids as UUIDs before putting them in a URL); a checkpoint's id
  is derived from its path, so it needs no table of its own;
* operation ids are the runtime's request ids (opaque strings to the SDK);
* checkpoint paths are ``weaver://{model_id}/checkpoints/{name}`` for training state,
  ``weaver://{model_id}/sampler_weights/{name}`` for sampler exports and
  ``weaver://{model_id}/exports/{name}`` for HF exports to download (the SDK knows
  those by their artifact id, `checkpoint_id` of that path); the SDK reads the model
  id back from the first segment.
"""

from __future__ import annotations

import uuid

from nexrl_service.runtime import CheckpointPathFormat

__all__ = ["PATHS", "checkpoint_id", "checkpoint_path", "new_id", "parse_weaver_path"]

PATHS = CheckpointPathFormat(
    "weaver://",
    {"checkpoints": "training", "sampler_weights": "sampler", "exports": "external"},
    example="weaver://<model_id>/checkpoints/<name> or weaver://<model_id>/sampler_weights/<name>",
)
"""``weaver://`` paths."""
checkpoint_path = PATHS.path
parse_weaver_path = PATHS.parse
_NAMESPACE = uuid.UUID("6b0f3c52-1d2e-4a8f-9a43-5d0b8f1c7e21")


def new_id() -> str:
    return str(uuid.uuid4())


def checkpoint_id(path: str) -> str:
    """The UUID the SDK names a checkpoint by: a stable function of its path."""
    return str(uuid.uuid5(_NAMESPACE, path))
