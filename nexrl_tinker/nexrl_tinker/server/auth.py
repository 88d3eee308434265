"""API-key checks; the caller's key also names its tenant.

The SDK always sends ``X-API-Key`` (a ``tml-...`` key, or it refuses to start).
With a configured key, anything else is refused (constant-time comparison). Without
one, any ``tml-`` key is accepted and the key itself separates tenants: sessions,
models, samplers and checkpoints belong to the hash of the key that created them, and
another key gets a 403 for them. Only the hash is stored.
"""

from __future__ import annotations

import hashlib
import hmac

from nexrl_tinker.server.errors import Unauthorized

__all__ = ["Authenticator", "owner_of"]

KEY_PREFIX = "tml-"


def owner_of(api_key: str) -> str:
    """The tenant id stored with every resource: a SHA-256 of the key, never the key."""
    return hashlib.sha256(api_key.encode("utf-8")).hexdigest()[:32]


class Authenticator:
    def __init__(self, api_key: str | None) -> None:
        self._expected = api_key.encode("utf-8") if api_key else None

    def check(self, header: str | None) -> str:
        """Return the caller's owner id or raise `Unauthorized` with the reason."""
        if not header:
            raise Unauthorized("missing X-API-Key header; the tinker SDK sends TINKER_API_KEY there")
        if self._expected is not None:
            if not hmac.compare_digest(header.encode("utf-8"), self._expected):
                raise Unauthorized("invalid API key: this server was started with --api-key and the key does not match")
        elif not header.startswith(KEY_PREFIX):
            raise Unauthorized(f"invalid API key: keys must start with {KEY_PREFIX!r}")
        return owner_of(header)
