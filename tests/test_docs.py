"""Every hook spec is documented, with its exact signature, in the plugin guide."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from nexrl_core import hookspecs

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"
HOOKS = sorted(name for name in dir(hookspecs) if name.startswith("nexrl_"))


def test_there_are_hooks() -> None:
    assert HOOKS == [
        "nexrl_advantage_estimators",
        "nexrl_backends",
        "nexrl_group_engines",
        "nexrl_metrics_sinks",
        "nexrl_placers",
        "nexrl_policy_losses",
        "nexrl_rollout_sources",
        "nexrl_service_holders",
        "nexrl_services",
        "nexrl_tasks",
        "nexrl_trainers",
        "nexrl_transports",
    ]


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_documented_with_its_signature(hook: str) -> None:
    signature = str(inspect.signature(getattr(hookspecs, hook))).replace("'", "")
    assert f"### {hook}{signature}\n" in GUIDE.read_text()


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_has_a_docstring(hook: str) -> None:
    assert inspect.getdoc(getattr(hookspecs, hook))
