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

import re
import secrets
import uuid

import attrs

from nexrl_service.errors import BadRequest

__all__ = [
    "CHECKPOINT_SEGMENTS",
    "TinkerPath",
    "check_checkpoint_name",
    "checkpoint_path",
    "model_id_for",
    "new_sampler_id",
    "new_session_id",
    "parse_tinker_path",
]

SCHEME = "tinker://"
CHECKPOINT_SEGMENTS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
"""Path segment → the SDK's ``CheckpointType``."""
SEGMENT_OF_KIND = {kind: segment for segment, kind in CHECKPOINT_SEGMENTS.items()}
_NAME_RE = re.compile(r"^[^/\\\x00-\x1f]{1,200}$")


def new_session_id() -> str:
    return str(uuid.uuid4())


def model_id_for(session_id: str, model_seq_id: int) -> str:
    return f"{session_id}:train:{model_seq_id}"


def new_sampler_id(session_id: str, seq: int) -> str:
    return f"{session_id}_{seq}_{secrets.token_hex(4)}"


def check_checkpoint_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name) or name in (".", ".."):
        raise BadRequest(
            f"invalid checkpoint name {name!r}: use 1-200 characters without '/', '\\' or control characters"
        )
    return name


def checkpoint_path(model_id: str, kind: str, name: str) -> str:
    return f"{SCHEME}{model_id}/{SEGMENT_OF_KIND[kind]}/{name}"


@attrs.frozen
class TinkerPath:
    path: str
    model_id: str
    kind: str
    """``training`` or ``sampler``."""
    name: str

    @property
    def checkpoint_id(self) -> str:
        return f"{SEGMENT_OF_KIND[self.kind]}/{self.name}"


def parse_tinker_path(path: str) -> TinkerPath:
    """Split a ``tinker://`` path or raise `BadRequest` saying what is wrong."""
    if not isinstance(path, str) or not path.startswith(SCHEME):
        raise BadRequest(f"invalid checkpoint path {path!r}: it must start with {SCHEME!r}")
    parts = path[len(SCHEME) :].split("/")
    if len(parts) != 3 or not all(parts):
        raise BadRequest(f"invalid checkpoint path {path!r}: expected tinker://<training_run_id>/weights/<name>")
    model_id, segment, name = parts
    if segment not in CHECKPOINT_SEGMENTS:
        raise BadRequest(
            f"invalid checkpoint path {path!r}: the middle segment must be one of {sorted(CHECKPOINT_SEGMENTS)}"
        )
    return TinkerPath(path, model_id, CHECKPOINT_SEGMENTS[segment], name)
