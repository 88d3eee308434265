"""nexrl-fsdp: NexRL's self-hosted torch backend.

The compute engine (`Engine`: loading, sampling with raw-model logprobs, registered
policy losses with Tinker semantics, AdamW, checkpoints) and the shipped tiny model
``nexrl-tiny``. Names are imported lazily so that ``import nexrl_fsdp.tiny.addition``
(the demo task, pure Python) does not pull in torch.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

# Before any submodule imports torch (they all import this package first): how OpenMP
# worker threads wait between parallel regions. Spinning without end (libgomp's ACTIVE
# default) makes a 2-thread torch op up to 100x slower as soon as another thread or
# process holds a core, e.g. a service's compute thread next to the rollout workers;
# sleeping at once (PASSIVE) pays a wake-up per region, ~40 % of a small model's
# forward_backward. A short spin, then sleep, avoids both. Only a default: an explicit
# OMP_WAIT_POLICY wins, and nothing changes if torch was already imported.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "ACTIVE"
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")

__version__ = "0.1.0"

_EXPORTS = {
    "Engine": "nexrl_fsdp.engine",
    "EngineConfig": "nexrl_fsdp.config",
    "LoraSettings": "nexrl_fsdp.config",
    "Datum": "nexrl_fsdp.types",
    "DatumOutput": "nexrl_fsdp.types",
    "ForwardResult": "nexrl_fsdp.types",
    "OptimStepResult": "nexrl_fsdp.types",
    "PromptSamples": "nexrl_fsdp.types",
    "SampledSequence": "nexrl_fsdp.types",
    "SamplingParams": "nexrl_fsdp.types",
    "SHIPPED_MODELS": "nexrl_fsdp.loading",
    "resolve_model_dir": "nexrl_fsdp.loading",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nexrl_fsdp' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
