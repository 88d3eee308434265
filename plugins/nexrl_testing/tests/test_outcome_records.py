"""Each test's outcome is recorded with its keys, so that the mutation list takes a test
that passed in this very run as its baseline instead of running it again."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from nexrl_testing.recipe_key_records import SUITES_ENDED_ENV, read_records, record_of, run_recording, wait_for_the_suites

CASES = """
import pytest

def test_passes():
    pass

def test_fails():
    assert False

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass

@pytest.mark.parametrize("value", [1, 2])
def test_one_case_fails(value):
    assert value == 1

@pytest.fixture
def broken_teardown():
    yield
    raise RuntimeError("teardown")

def test_passes_but_its_teardown_fails(broken_teardown):
    pass
"""


def test_a_test_counts_as_passed_only_when_every_phase_of_every_case_passed(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "cases"\nversion = "0"\n')
    (tmp_path / "test_cases.py").write_text(CASES)
    records = tmp_path / "records"
    records.mkdir()
    names = ["test_passes", "test_fails", "test_skipped", "test_one_case_fails", "test_passes_but_its_teardown_fails"]
    run_recording([f"test_cases.py::{name}" for name in names], tmp_path, records)
    found = read_records(records)
    passed = {name: record.passed for name in names if (record := record_of(f"test_cases.py::{name}", tmp_path, found))}
    assert passed == {
        "test_passes": True,
        "test_fails": False,
        "test_skipped": True,
        "test_one_case_fails": False,
        "test_passes_but_its_teardown_fails": False,
    }
    assert record_of("test_cases.py::test_one_case_fails[1]", tmp_path, found).passed


def test_a_reader_beside_the_suites_reads_only_once_they_have_ended(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutation list runs beside ``make test``'s suites: it must not read which of its
    tests passed before the suites say they have ended, or it takes a test still to run
    for one that failed."""
    ended = tmp_path / "suites-ended"
    monkeypatch.setenv(SUITES_ENDED_ENV, str(ended))
    threading.Timer(0.5, ended.touch).start()
    began = time.monotonic()
    wait_for_the_suites(poll_s=0.05)
    assert ended.exists() and time.monotonic() - began >= 0.4
    monkeypatch.delenv(SUITES_ENDED_ENV)
    began = time.monotonic()
    wait_for_the_suites()
    assert time.monotonic() - began < 0.5, "with nothing beside it, a reader does not wait"
