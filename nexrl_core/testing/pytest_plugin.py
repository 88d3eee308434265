"""pytest plugin shipped with NexRL (entry point ``pytest11``): markers and fixtures for plugin tests.

``sql_url`` runs a test once on SQLite and once on a throwaway PostgreSQL server
(`nexrl_core.testing.postgres`), each time with a fresh empty database, so every SQL
store is tested on both. The PostgreSQL variant skips, with the reason, only where the
server binaries or psycopg are missing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from nexrl_core.plugins import load_plugins
from nexrl_core.registry import Registry, build_registry, reset_registry


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: end-to-end test that takes more than a few seconds")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Say how the PostgreSQL variants of the SQL store tests went, so a log shows they ran."""
    outcomes: dict[str, int] = {}
    for outcome in ("passed", "failed", "skipped", "error"):
        for report in terminalreporter.stats.get(outcome, []):
            if "[postgresql" in getattr(report, "nodeid", "") and getattr(report, "when", "call") in ("call", "setup"):
                if outcome == "passed" and report.when != "call":
                    continue
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
    if outcomes:
        counts = ", ".join(f"{count} {outcome}" for outcome, count in sorted(outcomes.items()))
        terminalreporter.write_line(f"PostgreSQL variants of the SQL store tests: {counts}")


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


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[Any]:
    """One throwaway PostgreSQL server for the whole test session."""
    from nexrl_core.testing.postgres import PostgresServer, postgres_unavailable

    reason = postgres_unavailable()
    if reason is not None:
        pytest.skip(f"PostgreSQL variant skipped: {reason}")
    server = PostgresServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def sql_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A SQLAlchemy URL of a fresh, empty database: SQLite, then PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    return request.getfixturevalue("postgres_server").new_database()
