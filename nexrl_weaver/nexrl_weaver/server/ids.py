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

import re
import uuid

import attrs

from nexrl_service.errors import BadRequest

__all__ = ["WeaverPath", "check_name", "checkpoint_id", "checkpoint_path", "new_id", "parse_weaver_path"]

SCHEME = "weaver://"
SEGMENTS = {"checkpoints": "training", "sampler_weights": "sampler", "exports": "external"}
"""Path segment -> the runtime's checkpoint kind."""
SEGMENT_OF_KIND = {kind: segment for segment, kind in SEGMENTS.items()}
_NAME_RE = re.compile(r"^[^/\\\x00-\x1f]{1,200}$")
_NAMESPACE = uuid.UUID("6b0f3c52-1d2e-4a8f-9a43-5d0b8f1c7e21")


def new_id() -> str:
    return str(uuid.uuid4())


def checkpoint_id(path: str) -> str:
    """The UUID the SDK names a checkpoint by: a stable function of its path."""
    return str(uuid.uuid5(_NAMESPACE, path))


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name) or name in (".", ".."):
        raise BadRequest(f"invalid checkpoint name {name!r}: use 1-200 characters without '/', '\\' or control characters")
    return name


def checkpoint_path(model_id: str, kind: str, name: str) -> str:
    return f"{SCHEME}{model_id}/{SEGMENT_OF_KIND[kind]}/{name}"


@attrs.frozen
class WeaverPath:
    path: str
    model_id: str
    kind: str
    """``training``, ``sampler`` or ``external``."""
    name: str


def parse_weaver_path(path: object) -> WeaverPath:
    """Split a ``weaver://`` path or raise `BadRequest` saying what is wrong."""
    if not isinstance(path, str) or not path.startswith(SCHEME):
        raise BadRequest(f"invalid checkpoint path {path!r}: it must start with {SCHEME!r}")
    parts = path[len(SCHEME) :].split("/")
    if len(parts) != 3 or not all(parts) or parts[1] not in SEGMENTS:
        raise BadRequest(
            f"invalid checkpoint path {path!r}: expected weaver://<model_id>/checkpoints/<name> "
            f"or weaver://<model_id>/sampler_weights/<name>"
        )
    model_id, segment, name = parts
    return WeaverPath(path, model_id, SEGMENTS[segment], name)
