"""A worker group's key: the secret every party of one group holds, and nobody else.

Why: the workers' API and every ZMQ socket of a group (the command channel, rank 0's
data socket, a sampler's or a service's weights inbox) listen on a port, and on several
machines that port is reachable from the network. Whoever holds the key is part of the
run: the driver, the API server, the ranks (their watchdogs too), and a sampler process
the driver starts. A request to the workers' API without ``Authorization: Bearer <key>``
is refused with 401, and a ZMQ message whose MAC (`nexrl_fsdp.direct_zmq.wire`) was not
made with the key is dropped: nothing of either runs.

What it does not do: encrypt. Someone who can read the traffic (an untrusted network
between the nodes) sees the batches, the weights and the bearer token itself, and could
replay what they saw; across such a network run the group inside a VPN or a TLS tunnel.
The key keeps out anyone who can reach the sockets but does not hold it (another user of
a shared cluster, a port scanner, a mistyped address of another run).

A group started on this machine (`WorkerGroup`) makes a key of its own; a group
started by hand (``nexrl serve workers`` plus ``torchrun``) gets it through
``NEXRL_WORKER_KEY`` on every node and in the driver's environment (docs/self-hosted.md).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Sequence

from cryptography.hazmat.primitives.poly1305 import Poly1305

__all__ = [
    "ENV_WORKER_KEY",
    "MAC_BYTES",
    "MissingGroupKey",
    "bearer_header",
    "bearer_matches",
    "frames_mac",
    "key_from_env",
    "keys_match",
    "mac_matches",
    "new_group_key",
]

ENV_WORKER_KEY = "NEXRL_WORKER_KEY"
"""The environment variable that gives a rank, a watchdog, a sampler process or a driver
of a ``workers_url`` group the group's key."""

_BEARER = "Bearer "
_NONCE_BYTES = 16
MAC_BYTES = _NONCE_BYTES + 16
"""Bytes of a ZMQ message's MAC frame: the message's nonce, then its Poly1305 tag."""
_MAC_CONTEXT = b"nexrl-direct-zmq-mac-v2"
"""Hashed with each nonce, so a message's one-time key is never any other use of the group's key."""


class MissingGroupKey(RuntimeError):
    """A process that must hold the group's key was started without one (the message names
    `ENV_WORKER_KEY` and how to set it)."""


def new_group_key() -> str:
    """A fresh key: 32 random bytes (256 bits, so it cannot be guessed), URL-safe text so
    it travels in an environment variable and an HTTP header unchanged."""
    return secrets.token_urlsafe(32)


def key_from_env(what: str) -> str:
    """The group's key from `ENV_WORKER_KEY`; ``what`` names who needs it, for the error.

    :raises MissingGroupKey: when the variable is unset or empty: running without the key
        would mean either answering anyone or never being answered, so it is refused.
    """
    key = os.environ.get(ENV_WORKER_KEY, "")
    if not key:
        raise MissingGroupKey(
            f"{what} needs the worker group's key: set {ENV_WORKER_KEY} to the key `nexrl serve workers` "
            f"was given (--api-key or {ENV_WORKER_KEY}, or the one it printed), e.g. export {ENV_WORKER_KEY}=..."
        )
    return key


def bearer_header(key: str) -> dict[str, str]:
    """The HTTP header a party of the group sends on every call to the workers' API."""
    return {"authorization": _BEARER + key}


def keys_match(given: str | bytes, key: str) -> bool:
    """Whether ``given`` is the key, in time that does not depend on where they differ (a
    plain ``==`` would let a caller find the key byte by byte from response times)."""
    given_bytes = given.encode() if isinstance(given, str) else given
    return hmac.compare_digest(given_bytes, key.encode())


def bearer_matches(authorization: str | None, key: str) -> bool:
    """Whether an ``Authorization`` header's value is ``Bearer <key>`` (constant time)."""
    if authorization is None or not authorization.startswith(_BEARER):
        return False
    return keys_match(authorization[len(_BEARER) :], key)


def _tag(frames: Sequence[memoryview | bytes], key: str, nonce: bytes) -> bytes:
    """Poly1305 of the frames, each preceded by its length (8 bytes, big-endian), under
    the one-time key HMAC-SHA256(key, context, nonce).

    Poly1305 reads about 10 GB/s where HMAC-SHA256 reads under 2, and every message is
    read twice (sent and received): with HMAC over every frame the wire fell from 1.3 to
    0.45 GB/s, a 3 GB model's weights push from about 2 to 7 s. Poly1305 needs a key used
    for one message only, which the nonce gives (random 128 bits never repeat in practice).
    The lengths make the same bytes cut into frames differently another message, so a
    frame cannot be split or merged into its neighbour. Frames are read in place (a
    tensor's own memory, not a copy)."""
    poly = Poly1305(hmac.new(key.encode(), _MAC_CONTEXT + nonce, hashlib.sha256).digest())
    for frame in frames:
        view = frame if isinstance(frame, memoryview) else memoryview(frame)
        poly.update(view.nbytes.to_bytes(8, "big"))
        poly.update(view)
    return poly.finalize()


def frames_mac(frames: Sequence[memoryview | bytes], key: str) -> bytes:
    """The MAC of a ZMQ message's frames under ``key``: a fresh nonce, then the frames' tag (`_tag`)."""
    nonce = secrets.token_bytes(_NONCE_BYTES)
    return nonce + _tag(frames, key, nonce)


def mac_matches(frames: Sequence[memoryview | bytes], mac: memoryview | bytes, key: str) -> bool:
    """Whether ``mac`` is a MAC of ``frames`` under ``key`` (`frames_mac`; constant time)."""
    given = bytes(mac)
    if len(given) != MAC_BYTES:
        return False
    return hmac.compare_digest(given[_NONCE_BYTES:], _tag(frames, key, given[:_NONCE_BYTES]))
