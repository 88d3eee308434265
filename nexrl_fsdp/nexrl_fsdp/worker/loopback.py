"""Start one machine's worker ranks with every socket they listen on bound to 127.0.0.1.

``torchrun --standalone`` cannot: its agent hosts the rendezvous store and the process
group's store on TCPStore servers that listen on every interface, whatever endpoint it
is given (``--rdzv-endpoint=127.0.0.1:PORT`` included). A group on one machine needs none
of torchrun's elasticity, so this launcher stands in for it. It binds the store's socket
on 127.0.0.1 (a free port, so no race for it), hands it to rank 0, which serves the
group's TCPStore on that very socket (`process_group_store`), and starts the ranks with
torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``), gloo's and NCCL's sockets on the loopback interface, and the ranks'
data sockets on 127.0.0.1. Like torchrun it ends the other ranks when one fails, and all
of them when it is told to stop; each rank's watchdog ends the rank when this launcher is
gone. Several machines are explicit: torchrun with ``--nnodes`` and a rendezvous
endpoint, ``NEXRL_WORKER_IP`` for the data sockets (docs/self-hosted.md).

``python -m nexrl_fsdp.worker.loopback --nproc N -- -m nexrl_fsdp.worker --api-server-url URL --identifier NAME``
(after ``--``: what each rank runs with ``python``; the ``local`` placer,
`nexrl_fsdp.local_placer`, starts it so).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

from nexrl_core.training.placement import ENV_RANK_ADDRESS
from nexrl_fsdp.direct_zmq.protocol import ENV_STORE_FD

__all__ = ["LOOPBACK_ADDRESS", "LOOPBACK_INTERFACE", "process_group_store", "rank_environment"]

LOOPBACK_ADDRESS = "127.0.0.1"
LOOPBACK_INTERFACE = "lo"
"""Linux's loopback interface, where gloo's and NCCL's sockets go."""
_STOP_GRACE_S = 10.0
_POLL_S = 0.1


def rank_environment(rank: int, nproc: int, store_port: int) -> dict[str, str]:
    """What torchrun would set for ``rank`` of ``nproc`` on one node, with the store on
    127.0.0.1:``store_port`` and every other socket of the rank on the loopback too."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": LOOPBACK_ADDRESS,
        "MASTER_PORT": str(store_port),
        "GLOO_SOCKET_IFNAME": LOOPBACK_INTERFACE,
        "NCCL_SOCKET_IFNAME": LOOPBACK_INTERFACE,
        ENV_RANK_ADDRESS: LOOPBACK_ADDRESS,
    }


def process_group_store(rank: int, world_size: int, timeout: timedelta) -> Any:
    """The process group's TCPStore in a loopback group: rank 0 serves it on the socket
    the launcher bound on 127.0.0.1 (``ENV_STORE_FD``), the others connect to it. None
    under torchrun, whose rendezvous gives the store (``init_process_group``'s default)."""
    descriptor = os.environ.get(ENV_STORE_FD)
    if descriptor is None:
        return None
    import torch.distributed as dist

    port = int(os.environ["MASTER_PORT"])
    if rank == 0:
        return dist.TCPStore(
            LOOPBACK_ADDRESS, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False, master_listen_fd=int(descriptor)
        )
    return dist.TCPStore(LOOPBACK_ADDRESS, port, world_size, is_master=False, timeout=timeout)


def _stop(ranks: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM to every rank still running, SIGKILL to those still running after the grace."""
    for process in ranks:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + _STOP_GRACE_S
    for process in ranks:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def launch(nproc: int, command: list[str]) -> int:
    """Run ``nproc`` ranks of ``python command`` until they all
    exit (0), one fails (its exit status; the others are stopped) or this process is
    asked to stop (SIGTERM, SIGINT)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((LOOPBACK_ADDRESS, 0))
    port = int(listener.getsockname()[1])
    ranks: list[subprocess.Popen[bytes]] = []
    stopping: list[int] = []
    for received in (signal.SIGTERM, signal.SIGINT):
        signal.signal(received, lambda number, _frame: stopping.append(number))
    try:
        for rank in range(nproc):
            env = {**os.environ, **rank_environment(rank, nproc, port), ENV_STORE_FD: str(listener.fileno())}
            descriptors = (listener.fileno(),) if rank == 0 else ()
            ranks.append(subprocess.Popen([sys.executable, "-u", *command], env=env, pass_fds=descriptors, stdin=subprocess.DEVNULL))
        listener.close()
        while not stopping:
            codes = [process.poll() for process in ranks]
            failed = [code for code in codes if code not in (None, 0)]
            if failed:
                print(
                    f"nexrl_fsdp.worker.loopback: a rank exited with status {failed[0]}; stopping the others", file=sys.stderr, flush=True
                )
                return failed[0] if failed[0] > 0 else 128 - failed[0]
            if all(code == 0 for code in codes):
                return 0
            time.sleep(_POLL_S)
        return 128 + stopping[0]
    finally:
        listener.close()
        _stop(ranks)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m nexrl_fsdp.worker.loopback",
        description="Start a worker group's ranks on this machine, every socket on 127.0.0.1 (torchrun --standalone listens on all interfaces).",
    )
    parser.add_argument("--nproc", type=int, required=True, help="ranks to start (one per GPU, or CPU processes)")
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, help="after --: what each rank runs with python, e.g. -m nexrl_fsdp.worker ..."
    )
    args = parser.parse_args()
    if args.nproc < 1:
        parser.error(f"--nproc must be at least 1, got {args.nproc}")
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give each rank's command after --, e.g. -- -m nexrl_fsdp.worker --api-server-url URL --identifier NAME")
    sys.exit(launch(args.nproc, command))


if __name__ == "__main__":
    main()
