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
MAC_BYTES = 32
"""Bytes of a ZMQ message's MAC frame (HMAC-SHA256)."""
_MAC_CONTEXT = b"nexrl-direct-zmq-mac-v1"
"""Hashed first, so a MAC of a message is never valid as any other use of the same key."""


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


def frames_mac(frames: Sequence[memoryview | bytes], key: str) -> bytes:
    """HMAC-SHA256 under ``key`` of a ZMQ message's frames, each preceded by its length
    (8 bytes, big-endian): the same bytes cut into frames differently get another MAC,
    so a frame cannot be split or merged into its neighbour. Reads the frames in place
    (a tensor's own memory is hashed, not copied)."""
    mac = hmac.new(key.encode(), _MAC_CONTEXT, hashlib.sha256)
    for frame in frames:
        view = frame if isinstance(frame, memoryview) else memoryview(frame)
        mac.update(view.nbytes.to_bytes(8, "big"))
        mac.update(view)
    return mac.digest()


def mac_matches(frames: Sequence[memoryview | bytes], mac: memoryview | bytes, key: str) -> bool:
    """Whether ``mac`` is `frames_mac` of ``frames`` under ``key`` (constant time)."""
    return hmac.compare_digest(bytes(mac), frames_mac(frames, key))
