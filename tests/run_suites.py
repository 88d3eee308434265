"""`make test`: every distribution's tests, each from its own folder as a publisher runs
them, as many suites at once as there are CPUs.

Most of a suite's time is spent waiting on the processes its tests start (services,
torchrun ranks, `nexrl train`), so one suite leaves a core idle about half the time; two
at once keep both busy. Suites start longest first, and each one's output is printed
whole when it ends, so the log reads suite by suite.

Every suite records into one folder (``NEXRL_RECIPE_KEY_RECORDS``) which recipe keys each
test sets and how it went, and two tests read those records. The mutation list
(`tests/test_mutations.py::test_every_mutation_is_caught`, its slow entries left to
`make mutations`) takes the first CPU a suite leaves once every suite has started: one
copy of the repository while the others run, all its copies once they have ended (the
file ``NEXRL_SUITES_ENDED`` names tells it); only then does it read which of its named
tests passed in this run, each its own baseline. (Started beside the suites from the
first, it held the 2 cores at a load of 5-7, where tests that time a shutdown failed
for the load alone.) The recipe-key walk (`tests/test_recipe_keys.py`) runs last, on its own.

The linters (``LINTERS``) run over the whole repository as the first job, beside the
longest suite: mypy takes about a minute on one core, which run before the suites left the
other core idle. A finding fails `make test` like a failed suite.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
RUN_PYTEST = "import os, sys, pytest; code = pytest.main(); sys.stdout.flush(); sys.stderr.flush(); os._exit(int(code))"
"""pytest's verdict is its exit code once the session is over: the process then ends with
os._exit, skipping the interpreter's teardown, where the native threads third-party
clients leave behind (the tinker SDK's event loop and HTTP runtime, pyarrow's allocator)
once aborted a fully green run with "double free or corruption" after pytest had printed
its summary."""
MUTATIONS = "tests/test_mutations.py::test_every_mutation_is_caught"
READERS = ("tests/test_recipe_keys.py", MUTATIONS)
"""The tests that read what every other test recorded."""
SUITES_ENDED_ENV = "NEXRL_SUITES_ENDED"
"""As `nexrl_testing.recipe_key_records.SUITES_ENDED_ENV` (not imported: this runner needs
nothing but the standard library and attrs)."""
RESUME = ("tests/test_resume_real.py",)
ROOT_E2E = (
    "tests/test_signals_real.py", "tests/test_e2e_workers.py", "tests/test_e2e_weaver.py", "tests/test_eval.py",
    "tests/test_kl_end_to_end.py", "tests/test_wheelhouse.py",
)  # fmt: skip
"""The core's end-to-end files, in two suites of their own (resume and healing, the rest),
so that the core's tests, half of all the time, spread over the CPUs like the others."""


@attrs.frozen
class Suite:
    name: str
    folder: str
    """From the repository root."""
    args: tuple[str, ...] = ()


SUITES = (
    Suite("tests (resume)", ".", RESUME),
    Suite("tests (end to end)", ".", ROOT_E2E),
    Suite("nexrl_weaver", "nexrl_weaver"),
    Suite("nexrl_tinker", "nexrl_tinker"),
    Suite("nexrl_fsdp", "nexrl_fsdp"),
    Suite("tests", ".", ("tests", *(f"--ignore={path}" for path in RESUME + ROOT_E2E), *(f"--deselect={test}" for test in READERS))),
    Suite("nexrl_episodes", "plugins/nexrl_episodes"),
    Suite("nexrl_engine", "plugins/nexrl_engine"),
    Suite("nexrl_ray", "plugins/nexrl_ray"),
    Suite("nexrl_sinks", "plugins/nexrl_sinks"),
    Suite("nexrl_grpo", "plugins/nexrl_grpo"),
    Suite("nexrl_service", "plugins/nexrl_service"),
    Suite("nexrl_testing", "plugins/nexrl_testing"),
    Suite("nexrl_remote_api", "plugins/nexrl_remote_api"),
    Suite("nexrl_math", "plugins/nexrl_math"),
    Suite("nexrl-example-plugin", "examples/nexrl-example-plugin"),
)
"""Longest first (from a CI run's timings), so that the short ones fill the gaps at the end."""
BESIDE = Suite("tests (mutations)", ".", (MUTATIONS, "-s"))
"""Runs beside the last suites, and prints each mutation's verdict as it comes (``-s``)."""
LAST = Suite("tests (recipe keys)", ".", ("tests/test_recipe_keys.py",))


def gpu_suite(name: str, folder: str) -> Suite:
    """The folder's GPU test files alone: a device machine lacks what other test files
    import (the sinks' trackers, the fuzzers), and collecting them would fail there."""
    files = sorted(str(path.relative_to(ROOT / folder)) for path in (ROOT / folder / "tests").glob("test_gpu_*.py"))
    return Suite(name, folder, ("-m", "gpu", "-rs", *files))


GPU_SUITES = tuple(
    gpu_suite(name, folder)
    for name, folder in (("nexrl_engine", "plugins/nexrl_engine"), ("nexrl_fsdp", "nexrl_fsdp"), ("nexrl_tinker", "nexrl_tinker"),
                         ("nexrl_weaver", "nexrl_weaver"), ("tests", "."))
)  # fmt: skip
"""`make test-gpu`: the tests marked gpu (files test_gpu_*.py), every path trained on CUDA
and driven as a user does. They run all at once: each trains the tiny model, which leaves
the GPU mostly idle, so the suite takes as long as the slowest. Without a GPU every test
is collected and skipped."""
NO_TESTS = 5
"""pytest's exit status when it collected nothing (a GPU run of a suite without GPU tests)."""
LINTERS = {
    "ruff check": [PYTHON, "-m", "ruff", "check", "."],
    "ruff format": [PYTHON, "-m", "ruff", "format", "--check", "."],
    "mypy": [PYTHON, "-m", "mypy"],
}
"""What `make test` runs from the repository root before the suites (configured in the root
pyproject.toml); not on a GPU run, whose machine need not have them."""


def command(suite: Suite) -> list[str]:
    return [PYTHON, "-c", RUN_PYTEST, "--durations=60", *suite.args]


def run_linters(logs: Path, printing: threading.Lock) -> dict[str, tuple[int, float]]:
    """Each linter's exit status and seconds, its findings printed whole when it ends."""
    results = {}
    for name, argv in LINTERS.items():
        log = logs / f"{name.replace(' ', '_')}.log"
        began = time.monotonic()
        with log.open("wb") as out:
            code = subprocess.run(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT).returncode
        results[name] = (code, time.monotonic() - began)
        with printing:
            print(f"=== {name}: exit {code} in {results[name][1]:.0f} s", flush=True)
            sys.stdout.buffer.write(log.read_bytes())
            sys.stdout.flush()
    return results


def run_suite(
    suite: Suite, records: Path, logs: Path, printing: threading.Lock, jobs: int, extra_env: dict[str, str] | None = None
) -> tuple[int, float]:
    """Run ``suite`` with its output in a log, then print that log whole."""
    log = logs / f"{suite.name.replace(' ', '_').replace('(', '').replace(')', '')}.log"
    began = time.monotonic()
    env = {**environment(records, jobs), **(extra_env or {})}
    with log.open("wb") as out:
        code = subprocess.run(command(suite), cwd=ROOT / suite.folder, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    seconds = time.monotonic() - began
    with printing:
        print(f"=== pytest {suite.name} ({suite.folder}): exit {code} in {seconds:.0f} s", flush=True)
        sys.stdout.buffer.write(log.read_bytes())
        sys.stdout.flush()
    return code, seconds


def environment(records: Path, jobs: int) -> dict[str, str]:
    """Each suite's environment: the shared records folder, and each process's share of the
    CPUs for torch's threads (``OMP_NUM_THREADS``, unless set already). Two suites whose
    processes each spin as many threads as there are cores spend most of their time
    waiting on each other: two copies of the engine suite at once on 2 cores took 423 s
    at torch's default and 68 s with one thread each (one alone: 56 s either way).

    Python writes bytecode even where the shell says not to (``PYTHONDONTWRITEBYTECODE``,
    set on some machines of this kind): ``make install`` does not byte-compile, so without
    it every process the tests start (hundreds: runs, services, ranks, their watchdogs)
    compiled torch's, transformers' and pytest's Python anew, about 3 s of CPU each here."""
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // jobs))
    inherited = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    return {**inherited, "NEXRL_RECIPE_KEY_RECORDS": str(records), "OMP_NUM_THREADS": threads}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="suites at once (default: one per CPU)")
    parser.add_argument("--gpu", action="store_true", help="run the GPU suite (tests marked gpu), every distribution at once")
    args = parser.parse_args(argv)
    suites, jobs = (GPU_SUITES, len(GPU_SUITES)) if args.gpu else (SUITES, max(1, args.jobs))
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="nexrl-records-") as folder:
        records, logs = Path(folder) / "records", Path(folder) / "logs"
        records.mkdir()
        logs.mkdir()
        printing = threading.Lock()
        ended = Path(folder) / "suites-ended"
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            linting = None if args.gpu else pool.submit(run_linters, logs, printing)
            futures = {suite.name: pool.submit(run_suite, suite, records, logs, printing, jobs) for suite in suites}
            # queued last, so it takes the first CPU a suite leaves once every suite has started
            mutations = None if args.gpu else pool.submit(run_suite, BESIDE, records, logs, printing, jobs, {SUITES_ENDED_ENV: str(ended)})
            try:
                results = {name: future.result() for name, future in futures.items()}
            finally:
                ended.touch()
            if mutations is not None:
                results[BESIDE.name] = mutations.result()
        if not args.gpu:
            print(f"=== pytest {LAST.name} ({LAST.folder})", flush=True)
            last_began = time.monotonic()
            code = subprocess.run(command(LAST), cwd=ROOT / LAST.folder, env=environment(records, jobs)).returncode
            results[LAST.name] = (code, time.monotonic() - last_began)
    results.update(linting.result() if linting is not None else {})
    print(f"=== {len(results)} suites in {time.monotonic() - began:.0f} s, {jobs} at once")
    for name, (code, seconds) in sorted(results.items(), key=lambda item: -item[1][1]):
        print(f"{seconds:8.0f} s  {'ok    ' if code == 0 else f'exit {code}'}  {name}")
    failed = [name for name, (code, _) in results.items() if code not in ((0, NO_TESTS) if args.gpu else (0,))]
    if failed:
        print(f"tests failed in: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
