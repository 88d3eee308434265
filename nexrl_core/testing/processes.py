"""Find the processes a run started, to show that none outlives it, and what they listen on.

A test sets an environment variable to a fresh value for the command it runs; every
process that command starts (services, torchrun, worker ranks, watchdogs, rollout
clients) inherits it, so whatever still carries the value afterwards was left behind.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

__all__ = ["process_tree", "processes_with", "tcp_listeners"]


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
