"""Checkpoint paths as every protocol writes them: ``{scheme}{model_id}/{segment}/{name}``.

Tinker (``tinker://``) and Weaver (``weaver://``) name a checkpoint by such a path: the
model that saved it, a segment that says its kind (the runtime's ``training``,
``sampler`` or ``external``, `nexrl_service.files.CHECKPOINT_KINDS`) and the name the
client chose. Each protocol has its own scheme and segments (`CheckpointPathFormat`);
how a path is built and split, and which names a client may choose, are the same.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import attrs

from nexrl_service.errors import BadRequest

__all__ = ["CheckpointPath", "CheckpointPathFormat", "check_checkpoint_name"]

_NAME_RE = re.compile(r"^[^/\\\x00-\x1f]{1,200}$")


def check_checkpoint_name(name: object) -> str:
    """``name``, when it can be the last segment of a checkpoint path.

    :raises BadRequest: saying what a name may be.
    """
    if not isinstance(name, str) or not _NAME_RE.match(name) or name in (".", ".."):
        raise BadRequest(f"invalid checkpoint name {name!r}: use 1-200 characters without '/', '\\' or control characters")
    return name


@attrs.frozen
class CheckpointPath:
    """A checkpoint path, split."""

    path: str
    model_id: str
    kind: str
    """The runtime's checkpoint kind: ``training``, ``sampler`` or ``external``."""
    name: str
    segment: str
    """The protocol's segment for ``kind``."""

    @property
    def below_model(self) -> str:
        """``{segment}/{name}``: the path without its scheme and model (Tinker's checkpoint id)."""
        return f"{self.segment}/{self.name}"


@attrs.frozen
class CheckpointPathFormat:
    """How one protocol writes checkpoint paths."""

    scheme: str
    """``tinker://``."""
    segments: Mapping[str, str]
    """Path segment -> the runtime's checkpoint kind."""
    example: str
    """A path as the protocol's messages show it, e.g. ``tinker://<training_run_id>/weights/<name>``."""

    def path(self, model_id: str, kind: str, name: str) -> str:
        (segment,) = [segment for segment, of_kind in self.segments.items() if of_kind == kind]
        return f"{self.scheme}{model_id}/{segment}/{name}"

    def parse(self, path: object) -> CheckpointPath:
        """Split ``path`` or raise `BadRequest` saying what is wrong."""
        if not isinstance(path, str) or not path.startswith(self.scheme):
            raise BadRequest(f"invalid checkpoint path {path!r}: it must start with {self.scheme!r}")
        parts = path[len(self.scheme) :].split("/")
        if len(parts) != 3 or not all(parts):
            raise BadRequest(f"invalid checkpoint path {path!r}: expected {self.example}")
        model_id, segment, name = parts
        if segment not in self.segments:
            raise BadRequest(f"invalid checkpoint path {path!r}: the middle segment must be one of {sorted(self.segments)}")
        return CheckpointPath(path, model_id, self.segments[segment], name, segment)
