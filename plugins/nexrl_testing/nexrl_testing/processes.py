"""Find the processes a run started, to show that none outlives it, and what they listen on.

A test sets an environment variable to a fresh value for the command it runs; every
process that command starts (services, torchrun, worker ranks, watchdogs, rollout
clients) inherits it, so whatever still carries the value afterwards was left behind.
`ListenerWatch` follows those processes over the run's whole life and records every
TCP socket any of them ever listened on, however briefly (a weights push's inbox).
"""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

__all__ = ["ListenerWatch", "LOOPBACK", "process_gone", "process_tree", "processes_running", "processes_with", "tcp_listeners"]

LOOPBACK = ("127.0.0.1", "::1")
"""The addresses a local run may listen on."""


def processes_with(marker: str) -> list[int]:
    """Pids of this user's processes (other than this one) whose environment holds ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def processes_running(marker: str, module: str, *, argument: str | None = None) -> list[int]:
    """The processes carrying ``marker`` that run ``python -m module`` (not a launcher of it),
    and, with ``argument``, have it on their command line; sorted by pid."""
    found = []
    for pid in processes_with(marker):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # the module the first -m names: a launcher names its ranks' module later in its arguments
        runs = b"-m" in cmdline and cmdline[cmdline.index(b"-m") + 1 :][:1] == [module.encode()]
        if runs and (argument is None or argument.encode() in cmdline):
            found.append(pid)
    return sorted(found)


def process_gone(pid: int) -> bool:
    """True once ``pid`` no longer runs: gone, or a zombie its parent has not reaped yet
    (a test's child whose parent is the test process stays one until it is waited on)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def process_tree(root: int) -> list[int]:
    """``root`` and every process descended from it (read from /proc, Linux)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_bytes().rpartition(b")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    tree, pending = [], [root]
    while pending:
        pid = pending.pop()
        tree.append(pid)
        pending.extend(children.get(pid, []))
    return tree


def _address(hex_address: str) -> str:
    """``/proc/net/tcp[6]``'s hex address (32-bit words in host byte order) as text."""
    raw = bytes.fromhex(hex_address)
    host_order = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(host_order))


def tcp_listeners(pids: list[int]) -> list[tuple[int, str, int]]:
    """``(pid, address, port)`` of every TCP socket the processes ``pids`` listen on, as
    ``ss -ltnp`` shows them (read from /proc, Linux; a process that is gone is skipped)."""
    listening: dict[str, tuple[str, int]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                address, port = fields[1].rsplit(":", 1)
                listening[fields[9]] = (_address(address), int(port, 16))
    found = []
    for pid in pids:
        for link in _descriptor_targets(pid):
            inode = link[len("socket:[") : -1] if link.startswith("socket:[") else None
            if inode in listening:
                found.append((pid, *listening[inode]))
    return found


def _descriptor_targets(pid: int) -> list[str]:
    """What each open descriptor of ``pid`` points at (one closed meanwhile is skipped)."""
    try:
        descriptors = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return []
    targets = []
    for descriptor in descriptors:
        try:
            targets.append(os.readlink(descriptor))
        except OSError:
            continue
    return targets


def _listening(table_dir: str) -> dict[str, tuple[str, int]]:
    """Socket inode -> ``(address, port)`` of each TCP socket listening in ``table_dir``'s
    network namespace (``/proc/<pid>/net``); empty when the process is gone."""
    listening: dict[str, tuple[str, int]] = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(table_dir, table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A":  # TCP_LISTEN
                address, port = fields[1].rsplit(":", 1)
                listening[fields[9]] = (_address(address), int(port, 16))
    return listening


_SOCK_DIAG_BY_FAMILY, _NLMSG_ERROR, _NLMSG_DONE = 20, 2, 3
_NLM_F_REQUEST_DUMP = 0x1 | 0x300
_TCP_LISTEN = 10
_NETLINK_SOCK_DIAG = 4


def _listening_here() -> dict[str, tuple[str, int]]:
    """As `_listening`, for this process's network namespace, asked of the kernel through
    sock_diag netlink (as ``ss -ltn`` does): it walks the listening sockets only, where
    reading ``/proc/net/tcp`` walks the whole connection table (milliseconds a read)."""
    import socket
    import struct

    listening: dict[str, tuple[str, int]] = {}
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as diag:
        for family in (socket.AF_INET, socket.AF_INET6):
            # inet_diag_req_v2: family, protocol, ext, pad, states; then an empty inet_diag_sockid
            request = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 1 << _TCP_LISTEN) + bytes(48)
            diag.send(struct.pack("=IHHII", 16 + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST_DUMP, 1, 0) + request)
            done = False
            while not done:
                data = diag.recv(1 << 17)
                offset = 0
                while offset + 16 <= len(data):
                    length, kind = struct.unpack_from("=IH", data, offset)
                    if kind == _NLMSG_DONE:
                        done = True
                        break
                    if kind == _NLMSG_ERROR:
                        error = -struct.unpack_from("=i", data, offset + 16)[0]
                        raise OSError(error, f"sock_diag: {os.strerror(error)}")
                    # inet_diag_msg: family, state, timer, retrans, id (sport, dport, src, dst, if,
                    # cookie), expires, rqueue, wqueue, uid, inode
                    message_family = data[offset + 16]
                    (port,) = struct.unpack_from(">H", data, offset + 20)
                    source = data[offset + 24 : offset + 24 + (4 if message_family == socket.AF_INET else 16)]
                    (inode,) = struct.unpack_from("=I", data, offset + 16 + 68)
                    listening[str(inode)] = (socket.inet_ntop(message_family, source), port)
                    offset += (length + 3) & ~3
    return listening


class ListenerWatch:
    """Every ``(pid, address, port)`` that a run's processes ever listened on over TCP.

    The run's processes are those whose environment holds ``marker`` (give the command
    an environment variable set to it, as for `processes_with`) and their descendants.
    As a context manager, a thread samples them every ``interval_s``: the TCP sockets
    listening in their network namespace (a ZMQ ``tcp://`` bind is one too), matched to
    the processes by socket inode through ``/proc/<pid>/fd``. A socket that lives a few
    sampling intervals is seen: a weights push's inbox (tens of ms on the tiny model), the
    sampler process, a server that listens only for a while.

    A sample costs a tenth of a millisecond or so: the process list, the new processes'
    environments, and the listening sockets, asked of the kernel through sock_diag netlink
    (``/proc/<pid>/net/tcp`` and ``tcp6`` where that is refused, or for a process in
    another network namespace; those walk every connection, milliseconds a read). A
    process's descriptors are read only when a listening socket shows up that no known
    process holds. Linux only.
    """

    def __init__(self, marker: str, interval_s: float = 0.01) -> None:
        self.marker = marker
        self.interval_s = interval_s
        self.first_seen: dict[tuple[int, str, int], float] = {}
        """Each listener ever seen, and when first (``time.monotonic()``)."""
        self.last_seen: dict[tuple[int, str, int], float] = {}
        """Each listener ever seen, and when last."""
        self.pids: set[int] = set()
        """Every process of the run ever seen."""
        self.samples = 0
        self._marker = marker.encode()
        self._run: dict[int, bool] = {}  # pid -> whether it is one of the run's (decided at first sight)
        self._netns: dict[int, str] = {}  # the run's pid -> its network namespace
        self._owners: dict[str, tuple[int, ...]] = {}  # listening socket inode -> the run's pids holding it
        self._unowned: dict[str, int] = {}  # inode -> samples in a row no process of the run held it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._own_netns: str | None = os.readlink("/proc/self/ns/net")

    # --- what was seen --------------------------------------------------------------------------

    @property
    def seen(self) -> set[tuple[int, str, int]]:
        """Every ``(pid, address, port)`` any process of the run listened on, so far."""
        self._raise_error()
        with self._lock:
            return set(self.first_seen)

    def beyond_loopback(self) -> list[tuple[int, str, int]]:
        """The listeners seen on an address other than 127.0.0.1 and ::1 (sorted)."""
        return sorted(entry for entry in self.seen if entry[1] not in LOOPBACK)

    # --- running a command under the watch -----------------------------------------------------

    def run(
        self, command: Sequence[str], *, env: Mapping[str, str], timeout: float, cwd: str | Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``command`` (``env`` must hold the marker) as `subprocess.run` with captured
        text output, but end it as soon as a listener beyond the loopback is seen, so a
        test of a long run fails in seconds: SIGKILL to the command and to every process
        that holds the marker. Past ``timeout`` it is ended the same way and
        `subprocess.TimeoutExpired` raised."""
        if self._marker not in "\0".join(f"{key}={value}" for key, value in env.items()).encode():
            raise ValueError("the command's environment does not hold the watch's marker")
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("run a command inside `with ListenerWatch(marker) as watch:`")
        process = subprocess.Popen(command, env=dict(env), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + timeout
        while True:
            try:
                stdout, stderr = process.communicate(timeout=0.25)
                return subprocess.CompletedProcess(list(command), process.returncode, stdout, stderr)
            except subprocess.TimeoutExpired:
                timed_out = time.monotonic() > deadline
                with self._lock:
                    beyond = any(address not in LOOPBACK for _, address, _ in self.first_seen)
                if timed_out or beyond or self._error is not None:
                    break
        process.kill()
        for _ in range(10):  # a process may start another while its siblings are ended
            left = processes_with(self.marker)
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    continue
            time.sleep(0.1)
        stdout, stderr = process.communicate(timeout=60)  # a descendant without the marker may hold the pipes
        self._raise_error()
        if timed_out:
            raise subprocess.TimeoutExpired(list(command), timeout, stdout, stderr)
        return subprocess.CompletedProcess(list(command), process.returncode, stdout, stderr)

    # --- the watch ---------------------------------------------------------------------------------

    def __enter__(self) -> ListenerWatch:
        self._sample()
        self._thread = threading.Thread(target=self._watch, name="nexrl-listener-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        if exc is None:
            self._raise_error()

    def _watch(self) -> None:
        try:
            while not self._stop.wait(self.interval_s):
                self._sample()
        except BaseException as error:  # noqa: BLE001 - raised to the test by the next read or the exit
            self._error = error

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError("the listener watch failed") from self._error

    def _sample(self) -> None:
        """Look once: the run's processes now, and what they listen on."""
        now = time.monotonic()
        alive = self._run_pids()
        by_netns: dict[str, list[int]] = {}
        for pid in alive:
            netns = self._netns.get(pid)
            if netns is None:
                try:
                    netns = self._netns[pid] = os.readlink(f"/proc/{pid}/ns/net")
                except OSError:
                    continue
            by_netns.setdefault(netns, []).append(pid)
        listening: dict[str, tuple[str, int]] = {}
        unknown: dict[str, list[int]] = {}  # inode -> the pids of its namespace to look in
        for netns, pids in by_netns.items():
            table = self._listening_in(netns, pids)
            listening.update(table)
            unknown.update({inode: pids for inode in table if inode not in self._owners})
        if unknown:
            holders: dict[str, list[int]] = {}
            for pid in {pid for pids in unknown.values() for pid in pids}:
                for link in _descriptor_targets(pid):
                    if link.startswith("socket:["):
                        holders.setdefault(link[len("socket:[") : -1], []).append(pid)
            for inode in unknown:
                if inode in holders:
                    self._owners[inode] = tuple(sorted(holders[inode]))
                    self._unowned.pop(inode, None)
                else:
                    self._unowned[inode] = self._unowned.get(inode, 0) + 1
                    if self._unowned[inode] >= 5:  # not the run's: stop looking for it
                        self._owners[inode] = ()
        with self._lock:
            for inode, (address, port) in listening.items():
                for pid in self._owners.get(inode, ()):
                    self.first_seen.setdefault((pid, address, port), now)
                    self.last_seen[(pid, address, port)] = now
            self.pids.update(alive)
            self.samples += 1
        for inode in [inode for inode in self._owners if inode not in listening]:
            del self._owners[inode]
        for inode in [inode for inode in self._unowned if inode not in listening]:
            del self._unowned[inode]

    def _listening_in(self, netns: str, pids: list[int]) -> dict[str, tuple[str, int]]:
        """The listening sockets of the network namespace the processes ``pids`` are in."""
        if netns == self._own_netns:
            try:
                return _listening_here()
            except OSError:  # no sock_diag here (a sandbox): the tables, slower
                self._own_netns = None
        for pid in pids:  # the first process still alive gives the namespace's tables
            table = _listening(f"/proc/{pid}/net")
            if table or Path(f"/proc/{pid}").exists():
                return table
        return {}

    def _run_pids(self) -> list[int]:
        """The run's processes alive now: a new process is the run's when its environment
        holds the marker or its parent is the run's."""
        current = {int(entry) for entry in os.listdir("/proc") if entry.isdigit()}
        current.discard(os.getpid())
        recheck = self.samples % 50 == 0  # now and then, in case one was read while it started
        for pid in [pid for pid, ours in self._run.items() if pid not in current or (recheck and not ours)]:
            del self._run[pid]
            self._netns.pop(pid, None)
        new = sorted(pid for pid in current if pid not in self._run)
        parents: dict[int, int] = {}
        for pid in new:
            try:
                self._run[pid] = self._marker in Path(f"/proc/{pid}/environ").read_bytes()
                parents[pid] = int(Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                self._run[pid] = False
        changed = True
        while changed:  # a child started with an environment of its own is still the run's
            changed = False
            for pid, parent in parents.items():
                if not self._run[pid] and self._run.get(parent):
                    self._run[pid] = changed = True
        return [pid for pid in current if self._run.get(pid)]
