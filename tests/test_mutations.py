"""Tests of the tests: each mutation in ``tests/mutations.yaml`` breaks one promise on
purpose, in a throwaway copy of the repository, and the tests it names must fail there.

The copy holds the files git tracks (and untracked ones it does not ignore); its tests
run with ``PYTHONPATH`` listing the copy's distribution folders, so they import the
copy's code, not the installed one. Each named test runs on its own, from its own
distribution's folder, as ``make test`` runs it (in a pytest forked from the copy's
`tests/preloaded_pytest.py`, which imported torch and other heavy third-party
libraries once for all of them): once on the unmutated copy (it must
pass) and once per mutation that names it (it must fail). One copy per CPU, and one more, take
these runs as they come, a mutation restored on its copy before that copy's next run; a
test that passed in this run of ``make test`` is its own baseline. ``make test`` runs the
list beside its other suites, on one copy until they have ended.

``make mutations`` (``python tests/test_mutations.py``, or with mutation ids to run only
those) runs the list and prints, per mutation, the tests that caught it and how long it took; `test_every_mutation_is_caught`
runs it in CI. The cheap tests below check the list itself and the runner's verdicts.
"""

from __future__ import annotations

import ast
import concurrent.futures
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TypeVar

import attrs
import pytest
import yaml

from nexrl_testing.recipe_key_records import SUITES_ENDED_ENV, wait_for_the_suites

T = TypeVar("T")

ROOT = Path(__file__).resolve().parents[1]
MUTATIONS_FILE = ROOT / "tests" / "mutations.yaml"
LAUNCHER = ROOT / "tests" / "preloaded_pytest.py"
FIELDS = ("id", "file", "original", "replacement", "tests", "why")
OPTIONAL_FIELDS = ("slow",)
TEST_TIMEOUT_S = 600
TIMED_OUT = -1
"""`run_test`'s status (as ``preloaded_pytest.TIMED_OUT``) for a test still running after ``TEST_TIMEOUT_S`` (it and every
process it started are killed): a hang is not a failure that catches a mutation."""
FAILED = 1
"""pytest's exit status when tests ran and some failed (any other non-zero status means
they could not run: a collection error, a usage error, no such test)."""
RECORDING_ENV = ("NEXRL_RECIPE_KEY_RECORDS", "NEXRL_RECIPE_KEY_TEST")
"""The recipe-key recorder's variables: a mutation's test runs record nothing."""
UNUSED_PLUGINS = ("-p", "no:schemathesis", "-p", "no:hypothesispytest", "-p", "no:anyio")
"""pytest plugins no named test needs (the fuzzers call hypothesis and schemathesis
directly), left unloaded: importing them is about half of each named test's pytest
start (1.2 of 2.7 s), and the list starts a pytest per named test."""


@attrs.frozen
class Mutation:
    """One deliberate break, and the tests that must catch it."""

    id: str
    file: str
    """Path from the repository root."""
    original: str
    """Exact text of the file; it occurs exactly once."""
    replacement: str
    tests: tuple[str, ...]
    """``path::name`` from the repository root; each must fail with the mutation."""
    why: str
    """The promise the mutation breaks."""
    slow: bool = False
    """A named test is marked slow (it starts whole runs): `make mutations` runs the
    mutation, `make test` does not, so CI's list takes minutes, not most of an hour."""


def load_mutations(path: Path = MUTATIONS_FILE) -> list[Mutation]:
    """The list in ``path``; a malformed entry is an error naming it and what is wrong."""
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    entries = data.get("mutations") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a mapping with a 'mutations' list")
    mutations = []
    for index, entry in enumerate(entries):
        name = entry.get("id", "no id") if isinstance(entry, dict) else repr(entry)
        where = f"{path.name}: mutation {index} ({name})"
        if not isinstance(entry, dict) or not set(FIELDS) <= set(entry) <= {*FIELDS, *OPTIONAL_FIELDS}:
            given = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
            raise ValueError(
                f"{where}: needs exactly the keys {', '.join(FIELDS)} (and optionally {', '.join(OPTIONAL_FIELDS)}); has {given}"
            )
        if not isinstance(entry.get("slow", False), bool):
            raise ValueError(f"{where}: slow must be true or false")
        tests = entry["tests"]
        if not (isinstance(tests, list) and tests and all(isinstance(test, str) and "::" in test for test in tests)):
            raise ValueError(f"{where}: tests must be a non-empty list of path::name")
        text_fields = ("id", "file", "original", "replacement", "why")
        if not all(isinstance(entry[field], str) for field in text_fields) or entry["original"] == entry["replacement"]:
            raise ValueError(f"{where}: {', '.join(text_fields)} must be strings, and the replacement must differ")
        mutations.append(Mutation(**{**entry, "tests": tuple(tests)}))
    ids = [mutation.id for mutation in mutations]
    repeated = sorted({mutation_id for mutation_id in ids if ids.count(mutation_id) > 1})
    if repeated:
        raise ValueError(f"{path.name}: ids used more than once: {', '.join(repeated)}")
    return mutations


def misplaced(mutation: Mutation, root: Path) -> str | None:
    """Why ``mutation`` cannot be applied to the tree at ``root``, or None."""
    target = root / mutation.file
    if not target.is_file():
        return f"{mutation.id}: no file {mutation.file}"
    count = target.read_text(encoding="utf-8").count(mutation.original)
    if count != 1:
        return f"{mutation.id}: the original text occurs {count} times in {mutation.file}; it must occur exactly once"
    for test in mutation.tests:
        if not (root / test.partition("::")[0]).is_file():
            return f"{mutation.id}: no test file {test.partition('::')[0]}"
    return None


def marked_slow(root: Path, test: str) -> bool:
    """Whether the ``path::name`` test is marked slow, read from its source: its module's
    ``pytestmark``, or a decorator of its function or class that names ``slow``."""
    path, _, name = test.partition("::")
    tree = ast.parse((root / path).read_text(encoding="utf-8"))
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(target, ast.Name) and target.id == "pytestmark" for target in targets) and "slow" in ast.unparse(node.value):
            return True
    names = set(name.split("[")[0].split("::"))
    return any(
        isinstance(node, (ast.FunctionDef, ast.ClassDef))
        and node.name in names
        and any("slow" in ast.unparse(decorator) for decorator in node.decorator_list)
        for node in ast.walk(tree)
    )


# --- the throwaway copy ------------------------------------------------------------------------------


def source_files(root: Path) -> list[str]:
    """What git tracks, and untracked files it does not ignore (a test not committed yet)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root, capture_output=True, check=True,
    ).stdout.decode()  # fmt: skip
    return sorted({name for name in listed.split("\0") if name and (root / name).is_file()})


def distribution_dirs(root: Path) -> list[Path]:
    """Each distribution's folder (one ``pyproject.toml`` each), the root's first."""
    return sorted({path.parent for path in root.rglob("pyproject.toml")}, key=lambda folder: len(folder.parts))


@contextmanager
def throwaway_copy(root: Path) -> Iterator[Path]:
    """A copy of the repository's source files, removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="nexrl-mutants-"))
    try:
        for name in source_files(root):
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, folder / name)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def copy_environment(copy: Path) -> dict[str, str]:
    """The environment the copy's tests run in: its distributions first on the path, and
    bytecode written (`mutated` keeps a mutated module's from outliving its restore), so
    each named test's processes compile only the modules a mutation changed."""
    env = {key: value for key, value in os.environ.items() if key not in (*RECORDING_ENV, "PYTHONDONTWRITEBYTECODE")}
    env["PYTHONPATH"] = os.pathsep.join(str(folder) for folder in distribution_dirs(copy))
    return env


@attrs.define
class PreloadedPytest:
    """A copy's pytest launcher (`tests/preloaded_pytest.py`): each named test runs in a
    child it forks with the heavy libraries already imported, in the copy's environment."""

    process: subprocess.Popen[str]

    def run(self, folder: Path, args: Sequence[str], timeout_s: float) -> int:
        """pytest's exit status for ``args`` run from ``folder``, or `TIMED_OUT`."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps({"cwd": str(folder), "args": list(args), "timeout_s": timeout_s}) + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        if not answer:
            raise RuntimeError(f"the pytest launcher {LAUNCHER} ended (exit status {self.process.wait()}); its error is above")
        return int(json.loads(answer)["status"])


@contextmanager
def preloaded_pytest(copy: Path) -> Iterator[PreloadedPytest]:
    process = subprocess.Popen(
        [sys.executable, str(LAUNCHER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=copy, env=copy_environment(copy)
    )
    try:
        yield PreloadedPytest(process)
    finally:
        assert process.stdin is not None
        process.stdin.close()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run_test(launcher: PreloadedPytest, copy: Path, test: str) -> int:
    """pytest's exit status for one ``path::name`` of the copy, run from its distribution;
    a run past ``TEST_TIMEOUT_S`` is killed with every process of its session."""
    path, _, name = test.partition("::")
    test_file = copy / path
    folder = next(parent for parent in test_file.parents if (parent / "pyproject.toml").is_file())
    args = ["-q", "-x", "-p", "no:cacheprovider", *UNUSED_PLUGINS, f"{test_file.relative_to(folder)}::{name}"]
    return launcher.run(folder, args, TEST_TIMEOUT_S)


# --- running the list ----------------------------------------------------------------------------


@attrs.frozen
class Verdict:
    """How one mutation went."""

    mutation: Mutation
    statuses: dict[str, int]
    """Each named test → pytest's exit status with the mutation applied."""
    seconds: float

    @property
    def caught(self) -> bool:
        return all(status == FAILED for status in self.statuses.values())

    def problems(self) -> list[str]:
        problems = []
        for test, status in self.statuses.items():
            if status == 0:
                problems.append(f"{self.mutation.id}: survived {test} ({self.mutation.why})")
            elif status == TIMED_OUT:
                problems.append(
                    f"{self.mutation.id}: {test} did not end within {TEST_TIMEOUT_S} s with the mutation; it must fail, not hang"
                )
            elif status != FAILED:
                problems.append(f"{self.mutation.id}: {test} could not run with the mutation (pytest exit {status}); "
                                "the replacement must break the promise, not the import")  # fmt: skip
        return problems


@attrs.frozen
class Report:
    baseline: dict[str, int]
    """Each named test that was not known to pass already → its exit status on the
    unmutated copy (0 expected)."""
    verdicts: list[Verdict]
    seconds: float

    def problems(self) -> list[str]:
        problems = [
            f"{test} does not pass on the unmutated copy (pytest exit {status})" for test, status in self.baseline.items() if status
        ]
        return problems + [problem for verdict in self.verdicts for problem in verdict.problems()]


@contextmanager
def mutated(copy: Path, mutation: Mutation, serial: int) -> Iterator[None]:
    """``mutation`` applied to ``copy`` while the block runs.

    Python takes a module's cached bytecode when the source's modification time (whole
    seconds) and size match the ones it was compiled from. So the mutated file gets a
    time of its own, ``serial`` seconds (unique to the mutation) past the original's,
    and the restored file gets the original's time back: a mutated module's bytecode is
    never taken for the original or another mutation's, and the original's stays good."""
    target = copy / mutation.file
    original, stat = target.read_bytes(), target.stat()
    target.write_text(original.decode("utf-8").replace(mutation.original, mutation.replacement, 1), encoding="utf-8")
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns + serial * 1_000_000_000))
    try:
        yield
    finally:
        target.write_bytes(original)
        os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def default_copies() -> int:
    """One copy more than there are CPUs: a named test's run waits on the processes it
    starts (services, ranks) for part of its time, and with one copy per CPU the list
    kept 2 cores at a load of 1.2-1.5."""
    return (os.cpu_count() or 1) + 1


def run_mutations(
    mutations: Sequence[Mutation],
    root: Path = ROOT,
    verbose: bool = False,
    workers: int | None = None,
    passed: Callable[[], Collection[str]] = frozenset,
    held: int = 0,
    release: Callable[[], None] = lambda: None,
) -> Report:
    """Apply each mutation to a throwaway copy of ``root`` and run its tests; ``workers``
    copies (`default_copies`) take the mutations in turn, so every core is busy (each job
    is mostly one pytest's start), and then the baseline runs of the named tests.

    A named test that ``passed`` lists (asked once the mutations are done) already passed
    on this very source in this run (``make test`` records every test's outcome), which
    is its baseline: it is not run again. ``held`` of the copies take no work until
    ``release`` returns: beside ``make test``'s suites the list keeps to the cores they
    leave idle, and takes every copy once they have ended."""
    problems = [problem for mutation in mutations if (problem := misplaced(mutation, root))]
    if problems:
        raise ValueError("\n".join(problems))
    started = time.monotonic()
    workers = max(1, min(workers or default_copies(), len(mutations)))
    held = min(held, workers - 1)
    with ExitStack() as stack:
        folders = [stack.enter_context(throwaway_copy(root)) for _ in range(workers)]
        made = [(copy, stack.enter_context(preloaded_pytest(copy))) for copy in folders]
        copies: queue.Queue[tuple[Path, PreloadedPytest]] = queue.Queue()
        for slot in made[held:]:
            copies.put(slot)

        def release_the_held() -> None:
            release()
            for slot in made[:held]:
                copies.put(slot)

        if held:
            threading.Thread(target=release_the_held, name="held-copies", daemon=True).start()

        def on_a_copy(job: Callable[[tuple[Path, PreloadedPytest]], T]) -> T:
            slot = copies.get()
            try:
                return job(slot)
            finally:
                copies.put(slot)

        def verdict(serial: int, mutation: Mutation) -> Verdict:
            def job(slot: tuple[Path, PreloadedPytest]) -> Verdict:
                copy, launcher = slot
                began = time.monotonic()
                with mutated(copy, mutation, serial):
                    statuses = {test: run_test(launcher, copy, test) for test in mutation.tests}
                return Verdict(mutation, statuses, time.monotonic() - began)

            done = on_a_copy(job)
            if verbose:
                print(describe(done), flush=True)
            return done

        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            verdicts = list(pool.map(verdict, range(1, len(mutations) + 1), mutations))
            named = sorted({test for mutation in mutations for test in mutation.tests} - set(passed()))
            baseline = dict(zip(named, pool.map(lambda test: on_a_copy(lambda slot: run_test(slot[1], slot[0], test)), named)))
    return Report(baseline, verdicts, time.monotonic() - started)


def describe(verdict: Verdict) -> str:
    state = "caught" if verdict.caught else "NOT CAUGHT"
    return f"{verdict.mutation.id}: {state} in {verdict.seconds:.1f} s by {', '.join(verdict.mutation.tests)}"


# --- the tests ----------------------------------------------------------------------------------


def test_the_list_is_well_formed_and_each_mutation_applies() -> None:
    mutations = load_mutations()
    assert len(mutations) >= 10
    assert [problem for mutation in mutations if (problem := misplaced(mutation, ROOT))] == []
    wrongly_flagged = [mutation.id for mutation in mutations if mutation.slow != any(marked_slow(ROOT, test) for test in mutation.tests)]
    assert wrongly_flagged == [], "slow: true exactly when a named test is marked slow"


@pytest.mark.slow
def test_every_mutation_is_caught(passed_in_this_run: Callable[[Collection[str], Path], set[str]]) -> None:
    """Every mutation but the slow ones (`Mutation.slow`; ``make mutations`` runs those too)."""
    mutations = [mutation for mutation in load_mutations() if not mutation.slow]
    named = {test for mutation in mutations for test in mutation.tests}
    beside_the_suites = bool(os.environ.get(SUITES_ENDED_ENV))
    report = run_mutations(
        mutations, verbose=True, passed=lambda: passed_in_this_run(named, ROOT),
        held=default_copies() - 1 if beside_the_suites else 0, release=wait_for_the_suites,
    )  # fmt: skip
    print(
        f"{len(mutations)} mutations (the slow ones left to make mutations) in {report.seconds:.0f} s; "
        f"{len(report.baseline)} of {len(named)} named tests run for a baseline"
    )
    assert not report.problems(), "\n".join(report.problems())


KL_TEST = "plugins/nexrl_grpo/tests/test_kl.py::test_fixed_controller_never_moves"


@pytest.mark.slow
def test_a_mutation_no_test_catches_is_reported() -> None:
    """The test of the runner: a harmless change survives its test, and is reported;
    a real break of what the test checks is caught."""
    harmless = Mutation(
        id="docstring", file="plugins/nexrl_grpo/nexrl_grpo/kl.py", original='"""Keeps the KL coefficient constant."""',
        replacement='"""Keeps the KL coefficient fixed."""', tests=(KL_TEST,), why="changes no behaviour",
    )  # fmt: skip
    breaking = attrs.evolve(
        harmless, id="fixed-moves", original='"""Does nothing; present so both controllers can be driven the same way."""',
        replacement="self.value *= 2",
    )  # fmt: skip
    report = run_mutations([harmless, breaking])
    assert report.baseline == {KL_TEST: 0}
    assert [verdict.caught for verdict in report.verdicts] == [False, True]
    assert report.problems() == [f"docstring: survived {KL_TEST} (changes no behaviour)"]


@pytest.mark.slow
def test_a_mutations_bytecode_is_never_taken_for_the_next_one_on_the_same_copy() -> None:
    """Two mutations of one spot, the same size, one after the other on one copy (within
    a second): the second, harmless one must run its own code, not the first one's
    cached bytecode, and survive."""
    original = '"""Does nothing; present so both controllers can be driven the same way."""'
    breaking = Mutation(
        id="fixed-moves", file="plugins/nexrl_grpo/nexrl_grpo/kl.py", tests=(KL_TEST,), why="the fixed controller moves",
        original=original, replacement="self.value *= 2  # ".ljust(len(original), "x"),
    )  # fmt: skip
    harmless = attrs.evolve(breaking, id="same-size-docstring", replacement=f'"""{"y" * (len(original) - 6)}"""', why="-")
    assert len(breaking.replacement) == len(harmless.replacement) == len(original)
    report = run_mutations([breaking, harmless], workers=1, passed=lambda: {KL_TEST})
    assert [verdict.caught for verdict in report.verdicts] == [True, False]


@pytest.mark.slow
def test_a_named_test_that_passed_in_this_run_is_its_own_baseline() -> None:
    breaking = Mutation(
        id="fixed-moves", file="plugins/nexrl_grpo/nexrl_grpo/kl.py", tests=(KL_TEST,), why="the fixed controller moves",
        original='"""Does nothing; present so both controllers can be driven the same way."""', replacement="self.value *= 2",
    )  # fmt: skip
    report = run_mutations([breaking], passed=lambda: {KL_TEST})
    assert report.baseline == {}
    assert [verdict.caught for verdict in report.verdicts] == [True]


CONFTEST_SETTING = """
import os

os.environ["HF_HUB_OFFLINE"] = "1"
"""
SEES_THE_SETTING = """
def test_the_hub_is_offline():
    from huggingface_hub import constants

    assert constants.HF_HUB_OFFLINE
"""


def test_a_forked_pytest_takes_the_settings_its_conftest_makes(tmp_path: Path) -> None:
    """A conftest that sets ``HF_HUB_OFFLINE`` before anything imports huggingface_hub
    (nexrl_tinker's does) is obeyed in the launcher's child as in a plain pytest; with
    the Hub's library preloaded, every tokenizer load waited out the Hub's retries."""
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "conftest.py").write_text(CONFTEST_SETTING)
    (tmp_path / "test_setting.py").write_text(SEES_THE_SETTING)
    environment = {key: value for key, value in os.environ.items() if key != "HF_HUB_OFFLINE"}
    process = subprocess.Popen([sys.executable, str(LAUNCHER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=environment)
    try:
        assert PreloadedPytest(process).run(tmp_path, ["-q", "-p", "no:cacheprovider", "test_setting.py"], 120) == 0
    finally:
        assert process.stdin is not None
        process.stdin.close()
        process.wait(timeout=60)


def test_a_mutation_that_does_not_apply_is_refused() -> None:
    twice = Mutation(id="twice", file="plugins/nexrl_grpo/nexrl_grpo/kl.py", original="self.controller.value", replacement="self.other",
                     tests=(KL_TEST,), why="-")  # fmt: skip
    with pytest.raises(ValueError, match="twice: the original text occurs [0-9]+ times in plugins/nexrl_grpo/nexrl_grpo/kl.py"):
        run_mutations([twice])


def test_a_malformed_entry_is_named(tmp_path: Path) -> None:
    listed = tmp_path / "mutations.yaml"
    listed.write_text("mutations:\n  - id: lonely\n    file: x.py\n", encoding="utf-8")
    with pytest.raises(ValueError, match="mutation 0 \\(lonely\\): needs exactly the keys id, file, original"):
        load_mutations(listed)


if __name__ == "__main__":  # `make mutations`; `python tests/test_mutations.py ID ...` runs those alone
    chosen = load_mutations()
    if sys.argv[1:]:
        unknown = sorted(set(sys.argv[1:]) - {mutation.id for mutation in chosen})
        if unknown:
            sys.exit(f"no mutation with id {', '.join(unknown)} in {MUTATIONS_FILE}")
        chosen = [mutation for mutation in chosen if mutation.id in sys.argv[1:]]
    report = run_mutations(chosen, verbose=True)
    print(f"{len(report.verdicts)} mutations in {report.seconds:.0f} s")
    for problem in report.problems():
        print(problem)
    sys.exit(1 if report.problems() else 0)
