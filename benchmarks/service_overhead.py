"""What the Tinker and Weaver service-overhead benchmarks share: a service started with
``nexrl serve`` in its own process, paired timing, and the table they print.

Each benchmark times the same engine work twice, through its SDK against the local
service and as direct `nexrl_engine.Engine` calls, and prints one row per operation and
shape: both medians, their ratio and the milliseconds the service adds per call.
"""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

Row = tuple[str, str, float, float, int]
"""(operation, shape ``BxT``, service ms, engine ms, SDK calls per operation)."""


def timed_pair(a: Callable[[], object], b: Callable[[], object], reps: int, warmup: int) -> tuple[float, float]:
    """Median wall times of ``a`` and ``b`` in milliseconds, measured alternately so
    that load from other processes drifts into both columns alike."""
    for _ in range(warmup):
        a()
        b()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(reps):
        for fn, out in ((a, times[0]), (b, times[1])):
            start = time.perf_counter()
            fn()
            out.append((time.perf_counter() - start) * 1000)
    return statistics.median(times[0]), statistics.median(times[1])


def serve(name: str, data_dir: Path, health_route: str, timeout_s: float = 120) -> tuple[str, Callable[[], None]]:
    """``nexrl serve NAME`` on a free loopback port, once ``health_route`` answers;
    returns its URL and a function that stops it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    nexrl = Path(sys.executable).with_name("nexrl")
    process = subprocess.Popen(
        [str(nexrl), "serve", name, "--port", str(port), "--data-dir", str(data_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url + health_route, timeout=2) as answer:
                if answer.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline or process.poll() is not None:
            process.kill()
            raise RuntimeError(f"nexrl serve {name} did not start")
        time.sleep(0.1)

    def stop() -> None:
        process.terminate()
        process.wait(timeout=60)

    return url, stop


def print_table(title: str, rows: Sequence[Row], targets: str) -> None:
    print(f"\n{title}\n")
    header = f"{'operation':<30}{'shape':>8}{'service ms':>13}{'engine ms':>12}{'ratio':>8}{'added ms/call':>15}"
    print(header)
    print("-" * len(header))
    for name, shape, service_ms, engine_ms, calls in rows:
        added = (service_ms - engine_ms) / calls
        print(f"{name:<30}{shape:>8}{service_ms:>13.2f}{engine_ms:>12.2f}{service_ms / engine_ms:>8.2f}{added:>15.2f}")
    print(f"\nTargets: {targets}")
