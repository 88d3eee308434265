"""Per-episode API keys: signed, so the server can tell which episode and which claim a key is for.

A key is ``nxe-<episode id>-<attempt>-<signature>``, the signature an HMAC-SHA256 of the
episode id and attempt under a secret the server keeps. ``attempt`` counts how often
the episode went back to the queue; a requeued episode gets a new attempt, so the key
of a claim that went stale stops working even though its signature is still valid.
Whether the episode is still claimed is the server's business (`EpisodeBook`); a key
alone proves only which episode and claim it names.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import attrs

PREFIX = "nxe-"


class InvalidToken(ValueError):
    """A key that this server did not issue (or that is not an episode key at all)."""


@attrs.frozen
class TokenClaim:
    """What a valid key names."""

    episode_id: str
    attempt: int


class EpisodeTokens:
    """Issues and checks episode keys under one secret."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret if secret is not None else secrets.token_bytes(32)

    def _sign(self, episode_id: str, attempt: int) -> str:
        message = f"{episode_id}-{attempt}".encode("ascii")
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()[:32]

    def issue(self, episode_id: str, attempt: int) -> str:
        return f"{PREFIX}{episode_id}-{attempt}-{self._sign(episode_id, attempt)}"

    def check(self, token: str) -> TokenClaim:
        """The episode and attempt ``token`` names.

        :raises InvalidToken: for anything this server did not issue.
        """
        if not token.startswith(PREFIX):
            raise InvalidToken(f"not an episode key (episode keys start with {PREFIX!r}; use the api_key a claim returned)")
        parts = token[len(PREFIX) :].split("-")
        if len(parts) != 3 or not parts[1].isdigit():
            raise InvalidToken("malformed episode key; use the api_key a claim returned, unchanged")
        episode_id, attempt_text, signature = parts
        if not hmac.compare_digest(signature, self._sign(episode_id, int(attempt_text))):
            raise InvalidToken("episode key with a bad signature: it was not issued by this server")
        return TokenClaim(episode_id=episode_id, attempt=int(attempt_text))
