"""pytest plugin of this repository's own tests (entry point ``pytest11`` of
``nexrl-testing``, which ``make install`` installs and no user needs).

``sql_url`` runs a test once on SQLite and once on a throwaway PostgreSQL server
(`nexrl_testing.postgres`), each time with a fresh empty database, so every SQL
store is tested on both. The PostgreSQL variant skips, with the reason, only where the
server binaries or psycopg are missing.

While ``NEXRL_RECIPE_KEY_RECORDS`` names a directory (``make test`` sets it), every test's
recipe keys and outcome are recorded there (`nexrl_testing.recipe_key_records`), and a test
that asks for ``recipe_key_records`` or ``passed_in_this_run`` runs after every other test
of its session, so it reads what they set and how they went.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from nexrl_core.plugins.registry import get_registry
from nexrl_testing import recipe_key_records as key_records

RECORDS_FIXTURE = "recipe_key_records"
PASSED_FIXTURE = "passed_in_this_run"
READING_FIXTURES = (RECORDS_FIXTURE, PASSED_FIXTURE)
"""Fixtures that read what the session's other tests recorded: their tests run last."""
GPU_MARK = "gpu"
"""Marks a test that needs a CUDA GPU (`pytest_collection_modifyitems` skips it elsewhere)."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{GPU_MARK}: needs a CUDA GPU; skipped where torch sees none (files test_gpu_*.py)")
    directory = os.environ.get(key_records.RECORDS_ENV)
    os.environ.pop(key_records.NOW_ENV, None)  # a pytest started by a test records for its own tests
    if directory:
        os.environ[key_records.NOW_ENV] = str(Path(directory) / f"now-{os.getpid()}")
        key_records.set_running_now(None)
        for module in key_records.INSTRUMENTED_MODULES:
            importlib.import_module(module)
        key_records.start_recording(directory)
        get_registry()  # so that component options built directly are recorded from the first test
        paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if str(key_records.STARTUP_DIR) not in paths:
            os.environ["PYTHONPATH"] = os.pathsep.join([str(key_records.STARTUP_DIR), *filter(None, paths)])


def _recording() -> bool:
    return bool(os.environ.get(key_records.RECORDS_ENV))


def _test_id(item: pytest.Item) -> str:
    return f"{item.path}::{item.nodeid.partition('::')[2]}"


_SHARED_BY: dict[str, type[pytest.Collector] | None] = {
    "class": pytest.Class,
    "module": pytest.Module,
    "package": pytest.Package,
    "session": None,
}
"""Fixture scope → the node its value is shared by (None: the session)."""


def _shared_fixtures(item: pytest.Item) -> list[str]:
    """The recording ids of the shared (not per-test) fixtures ``item`` uses."""
    ids = []
    for name, definitions in getattr(item, "_fixtureinfo").name2fixturedefs.items():  # noqa: B009 - pytest.Item does not declare it
        scope = definitions[-1].scope
        if scope in _SHARED_BY:
            kind = _SHARED_BY[scope]
            # As pytest picks it: a class fixture used outside a class is the test's own.
            node = (item.getparent(kind) if kind is not None else None) or (item if kind is pytest.Class else item.session)
            ids.append(key_records.fixture_id(node.nodeid, name))
    return ids


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest) -> Iterator[None]:
    """What a shared fixture sets (the backend a module's tests share, say) is recorded
    under the fixture, and counts for every test that uses it."""
    if not _recording() or fixturedef.scope not in _SHARED_BY:
        yield
        return
    running = key_records.running_now()
    key_records.set_running_now(key_records.fixture_id(request.node.nodeid, fixturedef.argname))
    try:
        yield
    finally:
        key_records.set_running_now(running)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """Name the running test to the key recorder of every process of the session."""
    if not _recording():
        yield
        return
    key_records.set_running_now(_test_id(item))
    key_records.record_test(_test_id(item), "ran", _shared_fixtures(item))
    try:
        yield
    finally:
        key_records.set_running_now(None)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    test = key_records.running_now() if _recording() else None
    if test is None:
        return
    if report.skipped:
        key_records.record_test(test, "skipped")
    elif report.failed:
        key_records.record_test(test, "failed")
    elif report.when == "call":
        key_records.record_test(test, "passed")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that read the key records run last, after the tests whose keys they read;
    tests marked ``gpu`` are skipped, with the reason, where torch sees no CUDA GPU."""
    items.sort(key=lambda item: any(name in getattr(item, "fixturenames", ()) for name in READING_FIXTURES))
    gpu_items = [item for item in items if item.get_closest_marker(GPU_MARK) is not None]
    if gpu_items:
        from nexrl_testing.devices import NO_CUDA_REASON, cuda_available

        if not cuda_available():
            for item in gpu_items:
                item.add_marker(pytest.mark.skip(reason=NO_CUDA_REASON))


@pytest.fixture
def recipe_key_records(tmp_path: Path) -> Callable[[Iterable[str], Path], dict[str, key_records.TestRecord | None]]:
    """What the named tests (``path::name``, path from a root) set: read from this run's
    records where they ran in it (``make test``), else by running them now with recording
    on. A test that never ran maps to None."""

    def records_of(named: Iterable[str], root: Path) -> dict[str, key_records.TestRecord | None]:
        named = sorted(set(named))
        directory = os.environ.get(key_records.RECORDS_ENV)
        found = key_records.read_records(Path(directory)) if directory else {}
        missing = [test for test in named if key_records.record_of(test, root, found) is None]
        if missing:
            key_records.run_recording(missing, root, tmp_path)
            found = {**found, **key_records.read_records(tmp_path)}
        return {test: key_records.record_of(test, root, found) for test in named}

    return records_of


@pytest.fixture
def passed_in_this_run() -> Callable[[Iterable[str], Path], set[str]]:
    """Which of the named tests (``path::name``, path from a root) passed in this run's
    records (``make test``: every distribution's tests, before this one or, for a test
    that runs beside the suites, once they have ended); none when nothing is recorded."""

    def passed(named: Iterable[str], root: Path) -> set[str]:
        key_records.wait_for_the_suites()
        directory = os.environ.get(key_records.RECORDS_ENV)
        found = key_records.read_records(Path(directory)) if directory else {}
        return {test for test in named if (record := key_records.record_of(test, root, found)) is not None and record.passed}

    return passed


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


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[Any]:
    """One throwaway PostgreSQL server for the whole test session."""
    from nexrl_testing.postgres import PostgresServer, postgres_unavailable

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
