"""`ListenerWatch`: every socket a run's processes listen on over the run's life, however briefly."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid

import pytest

from nexrl_testing.processes import ListenerWatch, processes_with

LISTEN_BRIEFLY = """
import socket, subprocess, sys, time
for host in sys.argv[1:]:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as server:
        server.bind((host, 0))
        server.listen()
        print(server.getsockname()[1], flush=True)
        time.sleep(0.05)
"""
"""Listens on each address given for 50 ms, one after the other, printing each port."""

GRANDCHILD = """
import os, subprocess, sys
clean = {key: value for key, value in os.environ.items() if key != "NEXRL_WATCH_TEST"}
sys.exit(subprocess.run([sys.executable, "-c", sys.argv[1], *sys.argv[2:]], env=clean).returncode)
"""
"""Starts the listener in an environment without the marker: it is still the run's (a descendant)."""


def test_every_listener_of_the_run_is_seen_however_briefly_and_no_other() -> None:
    marker = uuid.uuid4().hex
    env = {**os.environ, "NEXRL_WATCH_TEST": marker}
    with socket.socket() as foreign, ListenerWatch(marker) as watch:
        foreign.bind(("0.0.0.0", 0))
        foreign.listen()  # this process's: not the run's
        done = subprocess.run(
            [sys.executable, "-c", LISTEN_BRIEFLY, "127.0.0.1", "::1", "0.0.0.0"], env=env, capture_output=True, text=True
        )
        clean = subprocess.run([sys.executable, "-c", GRANDCHILD, LISTEN_BRIEFLY, "127.0.0.1"], env=env, capture_output=True, text=True)
    ports = [int(port) for port in done.stdout.split()]
    assert done.returncode == 0 and len(ports) == 3, done.stderr
    seen = {(address, port) for _, address, port in watch.seen}
    assert seen == {("127.0.0.1", ports[0]), ("::1", ports[1]), ("0.0.0.0", ports[2]), ("127.0.0.1", int(clean.stdout))}, watch.seen
    assert [(address, port) for _, address, port in watch.beyond_loopback()] == [("0.0.0.0", ports[2])]
    assert len(watch.pids) >= 3, "the command, the child and its grandchild"


def test_a_zmq_bind_is_a_listener_and_a_run_that_listens_beyond_the_loopback_is_stopped_at_once() -> None:
    """`ListenerWatch.run` ends a run (and every process of it) the moment one listens
    beyond the loopback, instead of letting a long run go on to its end."""
    marker = uuid.uuid4().hex
    script = "import time, zmq; s = zmq.Context().socket(zmq.ROUTER); print(s.bind_to_random_port('tcp://*'), flush=True); time.sleep(600)"
    started = time.monotonic()
    with ListenerWatch(marker) as watch:
        done = watch.run([sys.executable, "-c", script], env={**os.environ, "NEXRL_WATCH_TEST": marker}, timeout=120)
    assert time.monotonic() - started < 30
    assert [(address, port) for _, address, port in watch.beyond_loopback()] == [("0.0.0.0", int(done.stdout))]
    assert done.returncode != 0 and processes_with(marker) == []


def test_run_refuses_an_environment_without_the_marker_and_a_watch_not_watching() -> None:
    marker = uuid.uuid4().hex
    with ListenerWatch(marker) as watch, pytest.raises(ValueError, match="marker"):
        watch.run([sys.executable, "-c", "pass"], env=dict(os.environ), timeout=10)
    with pytest.raises(RuntimeError, match="inside"):
        watch.run([sys.executable, "-c", "pass"], env={**os.environ, "NEXRL_WATCH_TEST": marker}, timeout=10)


def test_a_run_past_its_timeout_is_stopped_with_its_processes() -> None:
    marker = uuid.uuid4().hex
    env = {**os.environ, "NEXRL_WATCH_TEST": marker}
    with ListenerWatch(marker) as watch, pytest.raises(subprocess.TimeoutExpired):
        watch.run([sys.executable, "-c", "import time; time.sleep(600)"], env=env, timeout=1)
    assert processes_with(marker) == []


@pytest.mark.parametrize("through", ["sock_diag", "proc_tables"])
def test_both_ways_of_reading_the_listening_sockets_agree(through: str) -> None:
    """The kernel's sock_diag answer and ``/proc/<pid>/net/tcp[6]`` (the fallback) give the
    same inode, address and port, IPv4 and IPv6."""
    from nexrl_testing import processes

    with socket.socket() as v4, socket.socket(socket.AF_INET6) as v6:
        v4.bind(("127.0.0.1", 0))
        v6.bind(("::", 0))
        for server in (v4, v6):
            server.listen()
        expected = {
            str(os.fstat(v4.fileno()).st_ino): ("127.0.0.1", v4.getsockname()[1]),
            str(os.fstat(v6.fileno()).st_ino): ("::", v6.getsockname()[1]),
        }
        found = processes._listening_here() if through == "sock_diag" else processes._listening(f"/proc/{os.getpid()}/net")
    assert {inode: found.get(inode) for inode in expected} == expected
