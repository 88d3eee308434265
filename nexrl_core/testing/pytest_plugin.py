"""pytest plugin shipped with NexRL (entry point ``pytest11``), for plugin authors' tests:
the ``slow`` marker and the ``register_nexrl_plugin`` fixture.

This repository's own test machinery (recipe-key recording, throwaway PostgreSQL, GPU
skips) is the separate ``nexrl-testing`` distribution, which users never install.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from nexrl_core.plugins.loading import load_plugins
from nexrl_core.plugins.registry import Registry, build_registry, reset_registry


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: end-to-end test that takes more than a few seconds")


@pytest.fixture
def register_nexrl_plugin() -> Iterator[Callable[[Any, str], Registry]]:
    """Register an in-process plugin for one test, on top of the installed ones.

    Call it with a module or object holding ``@hookimpl`` functions and a name; it
    returns the rebuilt registry, which the module-level lookups (``get_policy_loss``
    and friends) use until the test ends.
    """
    extra: dict[str, Any] = {}

    def register(plugin: Any, name: str) -> Registry:
        extra[name] = plugin
        registry = build_registry(load_plugins(extra))
        reset_registry(registry)
        return registry

    yield register
    reset_registry()
