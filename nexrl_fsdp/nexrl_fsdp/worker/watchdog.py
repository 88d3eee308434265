"""A rank's watchdog process: beats for the rank while it lives, ends it when the run is gone.

A separate process, not a thread of the rank: a rank blocked in a collective or in a
long op may not let a Python thread run for minutes, and liveness must not depend on
it. The watchdog posts a heartbeat every interval while the rank's process exists,
reports the rank's exit the moment it sees it (so a dead rank is a dead group at once),
and kills the rank when its launcher (torchrun's agent, or
`nexrl_fsdp.worker.loopback`) is gone, when the API server
stops answering or calls the group dead or destroyed, so no rank outlives its run.

``python -m nexrl_fsdp.worker.watchdog --pid PID --parent PPID --rank R --group-url URL --interval S``

It inherits the rank's environment, the group's key (``NEXRL_WORKER_KEY``) included, and
sends it as a bearer token with every beat and report: the API server answers nothing
without it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
import urllib.error
import urllib.request

from nexrl_fsdp.direct_zmq.group_key import bearer_header, key_from_env

_SERVER_GONE_AFTER_S = 30.0


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: a killed rank that torchrun has not reaped yet (a zombie)
    does not, so it stops beating at once and not when its agent gets round to it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return True  # no /proc to ask: the signal's answer stands
    return state != b"Z"


def watch(pid: int, parent: int, rank: int, group_url: str, interval: float, key: str) -> None:
    """Beat for ``pid`` until it exits; kill it when its run is gone (the API server, or
    ``parent``, the launcher that started it). Every request carries the group's ``key``."""
    last_ok = time.monotonic()
    body = json.dumps({"rank": rank}).encode()
    headers = {"content-type": "application/json", **bearer_header(key)}
    while _alive(pid):
        if not _alive(parent):
            os.kill(pid, signal.SIGKILL)
            return
        try:
            request = urllib.request.Request(f"{group_url}/heartbeat", data=body, method="POST", headers=headers)
            with urllib.request.urlopen(request, timeout=5) as response:
                status = json.loads(response.read()).get("status")
            last_ok = time.monotonic()
            if status in ("dead", "destroyed", "unknown"):
                time.sleep(2 * interval)  # a destroyed group's ranks are exiting on their own
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)
                return
        except (OSError, ValueError):
            if time.monotonic() - last_ok > max(_SERVER_GONE_AFTER_S, 3 * interval):
                os.kill(pid, signal.SIGKILL)
                return
        time.sleep(interval)
    _report_exit(rank, group_url, headers)


def _report_exit(rank: int, group_url: str, headers: dict[str, str]) -> None:
    """Tell the API server at once that the rank's process is gone (a group being
    destroyed ignores it; a rank that failed with an exception has said why already)."""
    body = json.dumps({"rank": rank, "error": "its process exited (its output is in the workers' log)"}).encode()
    request = urllib.request.Request(f"{group_url}/failed", data=body, method="POST", headers=headers)
    try:
        urllib.request.urlopen(request, timeout=5).close()
    except OSError:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m nexrl_fsdp.worker.watchdog")
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--group-url", required=True)
    parser.add_argument("--interval", type=float, required=True)
    args = parser.parse_args()
    watch(args.pid, args.parent, args.rank, args.group_url, args.interval, key_from_env(f"the watchdog of rank {args.rank}"))


if __name__ == "__main__":
    main()
