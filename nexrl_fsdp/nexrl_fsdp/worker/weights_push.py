"""Rank 0's half of ``push_weights``: send the gathered policy straight to a sampler process.

The weights go from rank 0 to the sampler as raw frames (`nexrl_fsdp.direct_zmq.wire`),
never through the driver, in the sampler process's ``load_weights`` request (see
`nexrl_fsdp.selfhosted.sampler_server`); the op finishes only once the sampler has
answered that it loaded them, so the driver's ``push_weights`` returning means every
sample asked for afterwards uses the new weights. Both ways the messages carry the MAC
of the group's key: the sampler loads nothing someone without the key sent, and rank 0
takes no answer from someone without it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import zmq

from nexrl_fsdp.direct_zmq import wire

__all__ = ["SamplerPushError", "push_weights"]


class SamplerPushError(RuntimeError):
    """The sampler process did not load the pushed weights (refused them, or never answered)."""


def push_weights(
    context: zmq.Context, endpoint: str, weights: Mapping[str, torch.Tensor], request_id: str, timeout_s: float, *, key: str
) -> None:
    """Send ``weights`` (MACed with the group's ``key``) to the sampler at ``endpoint`` and
    wait until it has loaded them.

    :raises SamplerPushError: naming the endpoint, when the sampler refuses them or does
        not answer within ``timeout_s``.
    """
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDBUF, 1 << 23)
    socket.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    try:
        socket.connect(endpoint)
        try:
            wire.send(socket, {"kind": "load_weights", "id": request_id}, weights, key=key)
        except zmq.Again:
            raise SamplerPushError(f"the sampler at {endpoint} did not take the weights within {timeout_s:.0f} s") from None
        while socket.poll(int(timeout_s * 1000)):
            try:
                _, reply = wire.recv(socket, key=key)
            except wire.UnauthenticatedMessage as error:
                raise SamplerPushError(f"the sampler at {endpoint} answered without the group's key: {error}") from None
            if reply.header.get("id") != request_id:
                continue
            if reply.header.get("kind") != "loaded":
                raise SamplerPushError(f"the sampler at {endpoint} did not load the weights: {reply.header.get('error', reply.header)}")
            return
        raise SamplerPushError(f"the sampler at {endpoint} did not answer within {timeout_s:.0f} s that it loaded the weights")
    finally:
        socket.close(linger=0)
