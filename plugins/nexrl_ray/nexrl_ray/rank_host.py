"""`RankHost`: the Ray actor that runs one rank's process on the node Ray placed it on.

The rank is a plain child process of the actor (``python <command>``, in a session of its
own), not code inside the actor: it runs exactly as under torchrun or the loopback
launcher, writes its output to the group's log on its node, and its watchdog ends it
when the actor's process is gone (a killed actor, a lost node), so nothing outlives
the placement. The actor holds the bundle's CPUs and GPUs for as long as the rank runs.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["RankHost"]

_STOP_GRACE_S = 10.0


class RankHost:
    """Starts, watches and stops one rank's process (a Ray actor; see `nexrl_ray.placer`)."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None

    def where(self) -> tuple[str, str, list[str]]:
        """This node's Ray id, its address, and the GPUs Ray gave this actor."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), [str(gpu) for gpu in ray.get_gpu_ids()]

    def free_port(self) -> int:
        """A TCP port free on this node now (rank 0's node: the group's rendezvous)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("", 0))
            return int(probe.getsockname()[1])

    def start(self, command: Sequence[str], env: Mapping[str, str], log_path: str) -> int:
        """Start ``python command`` with ``env`` added to this actor's environment; its
        output goes to ``log_path`` on this node. Returns its process id."""
        path = Path(log_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-u", *command],
                env={**os.environ, **env},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self.process.pid

    def exit_code(self) -> int | None:
        """The rank's exit status once it has exited, else None."""
        return None if self.process is None else self.process.poll()

    def stop(self) -> None:
        """SIGTERM the rank's session, SIGKILL it after a grace period."""
        if self.process is None:
            return
        if self.process.poll() is None:
            _signal_session(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        _signal_session(self.process.pid, signal.SIGKILL)
        self.process.wait()


def _signal_session(session_id: int, number: int) -> None:
    try:
        os.killpg(session_id, number)
    except ProcessLookupError:
        pass
