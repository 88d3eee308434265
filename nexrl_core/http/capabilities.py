"""What NexRL's own services tell NexRL's holders beyond the public API they speak.

A service NexRL runs (the local Tinker- or Weaver-compatible one) answers
`NEXRL_CAPABILITIES_ROUTE`; a hosted service does not. From the answer a holder knows
that every registered loss and all its options are computed there, and in which
precision the service trains, so a recipe asking for another one is refused up front.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

import attrs

__all__ = ["NEXRL_CAPABILITIES_ROUTE", "NexrlCapabilities", "probe_nexrl_capabilities"]

NEXRL_CAPABILITIES_ROUTE = "/api/v1/nexrl_capabilities"


@attrs.frozen
class NexrlCapabilities:
    """What a NexRL service does beyond its public API."""

    dtype: str
    """The precision it trains and samples in, in a recipe's ``model.dtype`` terms (``fp32``, ``bf16``)."""
    max_context_length: int | None = None
    """Tokens the served model's context holds, when its config says."""
    device: str | None = None
    """Where its engines live (``cpu``, ``cuda``, ``cuda:1``; ``nexrl serve NAME --device``);
    None from a service too old to say."""

    def to_json(self) -> dict[str, Any]:
        return {"loss_options": "all", "dtype": self.dtype, "max_context_length": self.max_context_length, "device": self.device}


def probe_nexrl_capabilities(base_url: str | None, headers: Mapping[str, str], api: str) -> NexrlCapabilities | None:
    """Ask the service at ``base_url``; None for a service that is not NexRL's (or no URL:
    the SDK's hosted default).

    :raises RuntimeError: when the service cannot be reached at all, naming ``api``.
    """
    if not base_url:
        return None
    request = urllib.request.Request(base_url.rstrip("/") + NEXRL_CAPABILITIES_ROUTE, headers=dict(headers))
    try:
        with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310 - the configured service URL
            answer = json.loads(response.read())
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError) as error:
        raise RuntimeError(f"cannot reach the {api} service at {base_url}: {error}") from error
    context, device = answer.get("max_context_length"), answer.get("device")
    return NexrlCapabilities(
        dtype=str(answer.get("dtype", "fp32")),
        max_context_length=int(context) if context else None,
        device=str(device) if device else None,
    )
