"""The conformance kit: contract test classes that a plugin's own tests subclass.

A plugin author writes ``class TestMine(AdvantageEstimatorContract)`` with a fixture that
builds the implementation, and pytest runs the same checks our own plugins pass. The
contracts import torch, so they load only when a test names them; the pytest plugin in
`nexrl_core.testing.pytest_plugin` (loaded into every pytest run through ``pytest11``)
stays cheap.
"""

from __future__ import annotations

from typing import Any

_CONTRACTS = {
    "AdvantageEstimatorContract": "nexrl_core.testing.advantage_contract",
    "BackendContract": "nexrl_core.testing.backend_contract",
    "LossOptionCase": "nexrl_core.testing.loss_option_contract",
    "LossOptionContract": "nexrl_core.testing.loss_option_contract",
    "PolicyLossContract": "nexrl_core.testing.loss_contract",
    "ServiceHolderContract": "nexrl_core.testing.holder_contract",
    "ToolCallContract": "nexrl_core.testing.toolcall_contract",
    "TrainerContract": "nexrl_core.testing.backend_contract",
    "TransportContract": "nexrl_core.testing.transport_contract",
}

__all__ = sorted(_CONTRACTS)


def __getattr__(name: str) -> Any:
    module_name = _CONTRACTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'nexrl_core.testing' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module_name), name)
