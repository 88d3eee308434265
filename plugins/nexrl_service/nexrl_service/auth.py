"""API-key checks; the caller's key also names its tenant.

With a configured key, any other key is refused (constant-time comparison). Without
one, any key the protocol's policy accepts is let in and the key itself separates
tenants: sessions, models, samplers and checkpoints belong to the hash of the key
that created them, and another key gets a 403 for them. Only the hash is stored.

A protocol supplies what differs: the header its SDK sends the key in, a hint for a
missing key, the prefix its SDK's keys must have when no key is configured
(e.g. ``Authenticator(None, header="X-API-Key", required_prefix="sk-")``), and
whether a request without a key is let in when no key is configured
(``allow_anonymous``: an SDK that sends no header without a key, such as Weaver's;
such callers share the one tenant `ANONYMOUS_OWNER`).
"""

from __future__ import annotations

import hashlib
import hmac

from nexrl_service.errors import Unauthorized

__all__ = ["ANONYMOUS_OWNER", "Authenticator", "owner_of"]

ANONYMOUS_OWNER = "anonymous"
"""The tenant of requests without a key on a server started without one."""


def owner_of(api_key: str) -> str:
    """The tenant id stored with every resource: a SHA-256 of the key, never the key."""
    return hashlib.sha256(api_key.encode("utf-8")).hexdigest()[:32]


class Authenticator:
    """Checks the key of each request against the configured key or the open policy."""

    def __init__(
        self,
        api_key: str | None,
        *,
        header: str = "X-API-Key",
        required_prefix: str = "",
        missing_hint: str = "",
        allow_anonymous: bool = False,
    ) -> None:
        self._expected = api_key.encode("utf-8") if api_key else None
        self.header = header
        """The header the key travels in (only named in messages: routes read it)."""
        self._prefix = required_prefix
        self._missing = f"missing {header} header" + (f"; {missing_hint}" if missing_hint else "")
        self._anonymous = allow_anonymous and self._expected is None

    def check(self, key: str | None) -> str:
        """Return the caller's owner id or raise `Unauthorized` with the reason."""
        if not key:
            if self._anonymous:
                return ANONYMOUS_OWNER
            raise Unauthorized(self._missing)
        if self._expected is not None:
            if not hmac.compare_digest(key.encode("utf-8"), self._expected):
                raise Unauthorized("invalid API key: this server was started with --api-key and the key does not match")
        elif not key.startswith(self._prefix):
            raise Unauthorized(f"invalid API key: keys must start with {self._prefix!r}")
        return owner_of(key)
