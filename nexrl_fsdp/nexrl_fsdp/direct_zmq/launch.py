"""Start a worker group on this machine for one run (API server + ranks) and end it again.

`LocalWorkerGroup` is what the self-hosted backend and the tests use: an API server in a
thread of this process (on 127.0.0.1), ``python -m nexrl_fsdp.worker.loopback --nproc=N``
in its own session (it starts the ranks as torchrun would, with every socket they
listen on bound to 127.0.0.1, and stopping it ends every rank), and a connected
transport. Ranks also exit on their own when the API server goes away, so nothing
outlives the run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO

from nexrl_core.serving import ServeOptions
from nexrl_fsdp.direct_zmq.api_server import WorkersApiServer
from nexrl_fsdp.direct_zmq.protocol import ENV_HEARTBEAT_INTERVAL
from nexrl_fsdp.direct_zmq.transport import DirectZmqOptions, DirectZmqTransport, WorkerGroupError

__all__ = ["LocalWorkerGroup"]

_STOP_TIMEOUT_S = 15.0


class LocalWorkerGroup:
    """An API server, ``nproc`` worker ranks on the loopback, and a transport to them."""

    def __init__(
        self,
        nproc: int,
        log_path: Path,
        *,
        identifier: str = "actor",
        heartbeat_s: float = 5.0,
        dead_after_s: float = 15.0,
        connect_timeout_s: float = 180.0,
        op_timeout_s: float = 600.0,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.nproc = nproc
        self.log_path = Path(log_path)
        self.server = WorkersApiServer(ServeOptions(port=0), dead_after_s=dead_after_s)
        url = self.server.start()
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        try:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed by stop()
            env = {**os.environ, ENV_HEARTBEAT_INTERVAL: str(heartbeat_s), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(extra_env or {})}
            self.process = subprocess.Popen(
                [sys.executable, "-m", "nexrl_fsdp.worker.loopback", f"--nproc={nproc}",
                 "--", "--api-server-url", url, "--identifier", identifier],
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
            self.transport = DirectZmqTransport(
                DirectZmqOptions(api_server_url=url, identifier=identifier, world_size=nproc,
                                 connect_timeout_s=connect_timeout_s, op_timeout_s=op_timeout_s, log_path=str(self.log_path))
            )
            self.transport.initialize_worker()
        except BaseException:
            self.stop()
            raise

    def rank_pids(self) -> dict[int, int]:
        """Each rank's process id, as the rank reported it."""
        return {int(rank): pid for rank, pid in self.transport.info()["pids"].items()}

    def ended(self) -> bool:
        """Whether the launcher (and so the whole group) has exited, or was stopped."""
        return self.process is None or self.process.poll() is not None

    def stop(self) -> None:
        """Destroy the group if it still answers, then end the launcher's session and the server."""
        transport = getattr(self, "transport", None)
        if transport is not None and self.process is not None and self.process.poll() is None:
            try:
                transport.destroy()
            except WorkerGroupError:
                pass
        if self.process is not None:
            try:
                self.process.wait(timeout=_STOP_TIMEOUT_S if transport is not None else 0.1)
            except subprocess.TimeoutExpired:
                pass
            if self.process.poll() is None:
                try:
                    os.killpg(self.process.pid, signal.SIGTERM)
                    self.process.wait(timeout=_STOP_TIMEOUT_S)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    try:
                        os.killpg(self.process.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    self.process.wait()
            _end_session(self.process.pid)
            self.process = None
        if transport is not None:
            transport.close()
            self.transport = None  # type: ignore[assignment]
        if self._log is not None:
            self._log.close()
            self._log = None
        self.server.stop()

    def log_tail(self, limit: int = 4000) -> str:
        """The end of the workers' combined output (for error messages)."""
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return ""


def _end_session(session_id: int) -> None:
    """Kill whatever is left of the launcher's session once the launcher has exited: a
    rank that was stopped (SIGSTOP, a debugger) never acts on the SIGTERM it was sent."""
    try:
        os.killpg(session_id, signal.SIGKILL)
    except ProcessLookupError:
        pass
