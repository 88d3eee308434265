"""nexrl-engine: NexRL's single-device compute engine.

`Engine` (loading, sampling with raw-model logprobs, registered policy losses with Tinker
semantics, AdamW, LoRA, checkpoints), which the ``inprocess`` backend, the local services
and the FSDP workers all build on, and the shipped tiny model ``nexrl-tiny``. Names are imported lazily so that ``import nexrl_engine.tiny.addition``
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
    "Engine": "nexrl_engine.engine",
    "EngineConfig": "nexrl_engine.config",
    "LoraSettings": "nexrl_engine.config",
    "Datum": "nexrl_engine.types",
    "DatumOutput": "nexrl_engine.types",
    "ForwardResult": "nexrl_engine.types",
    "OptimStepResult": "nexrl_engine.types",
    "PromptSamples": "nexrl_engine.types",
    "SampledSequence": "nexrl_engine.types",
    "SamplingParams": "nexrl_engine.types",
    "SHIPPED_MODELS": "nexrl_engine.loading",
    "resolve_model_dir": "nexrl_engine.loading",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nexrl_engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
