"""The ``local`` placer: a worker group's ranks on this machine, every socket on 127.0.0.1.

It runs ``python -m nexrl_fsdp.worker.loopback --nproc N -- <command>`` in a session of
its own: the launcher starts the ranks with torchrun's environment and the process
group's store on the loopback (`nexrl_fsdp.worker.loopback`), ends the others when one
fails, and stopping its session ends every rank. The ranks' watchdogs end a rank whose
launcher is gone, so nothing outlives the group.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import IO

import attrs

from nexrl_core.training.placement import PlacementError, PlacementRequest, RankPlace, log_tail
from nexrl_fsdp.worker.loopback import LOOPBACK_ADDRESS

__all__ = ["LocalPlacer", "LocalPlacerOptions", "LocalRanks"]

_STOP_TIMEOUT_S = 15.0


@attrs.frozen
class LocalPlacerOptions:
    """The ``local`` placer takes no options: this machine is the cluster."""


class LocalRanks:
    """The loopback launcher of one group and the ranks it started."""

    def __init__(self, request: PlacementRequest) -> None:
        self.request = request
        self.log_path = Path(request.log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log: IO[bytes] | None = open(self.log_path, "ab")  # noqa: SIM115 - closed by stop()
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **request.env}
        try:
            self.process: subprocess.Popen[bytes] | None = subprocess.Popen(
                [sys.executable, "-m", "nexrl_fsdp.worker.loopback", f"--nproc={request.ranks}", "--", *request.command],
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        except OSError as error:
            self._log.close()
            raise PlacementError(f"could not start the ranks of group {request.group!r} on this machine: {error}") from error

    def places(self) -> list[RankPlace]:
        devices = self.request.env.get("CUDA_VISIBLE_DEVICES", "")
        gpus = devices.split(",") if devices else []
        return [
            RankPlace(rank, socket.gethostname(), LOOPBACK_ADDRESS, f"cuda:{gpus[rank]}" if rank < len(gpus) else "cpu")
            for rank in range(self.request.ranks)
        ]

    def ended(self) -> bool:
        return self.process is None or self.process.poll() is not None

    def stop(self, grace_s: float = _STOP_TIMEOUT_S) -> None:
        """Wait up to ``grace_s`` for the launcher to end on its own (a destroyed group's
        ranks exit by themselves), then SIGTERM its session, then SIGKILL what is left."""
        if self.process is not None:
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
            if self.process.poll() is None:
                try:
                    os.killpg(self.process.pid, signal.SIGTERM)
                    self.process.wait(timeout=_STOP_TIMEOUT_S)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    _kill_session(self.process.pid)
                    self.process.wait()
            _kill_session(self.process.pid)
            self.process = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, limit: int = 4000) -> str:
        return log_tail(self.log_path, limit)


class LocalPlacer:
    """Places every group on this machine."""

    def __init__(self, options: LocalPlacerOptions | None = None) -> None:
        self.options = options or LocalPlacerOptions()

    def control_host(self) -> str:
        return LOOPBACK_ADDRESS

    def place(self, request: PlacementRequest) -> LocalRanks:
        return LocalRanks(request)

    def close(self) -> None:
        """Nothing to let go of."""


def _kill_session(session_id: int) -> None:
    """Kill whatever is left of the launcher's session once the launcher has exited: a
    rank that was stopped (SIGSTOP, a debugger) never acts on the SIGTERM it was sent."""
    try:
        os.killpg(session_id, signal.SIGKILL)
    except ProcessLookupError:
        pass
