"""One rank: ``python -m nexrl_fsdp.worker --api-server-url URL --identifier NAME``, started by
``python -m nexrl_fsdp.worker.loopback --nproc=N -- ...`` on one machine or by ``torchrun -m
nexrl_fsdp.worker ...`` across several; either way with the group's key in ``NEXRL_WORKER_KEY``.
NexRL v1's worker flags and ``API_SERVER_URL`` are taken too (`arguments`)."""

from __future__ import annotations

import logging
import sys

import nexrl_engine  # noqa: F401 - sets the OpenMP wait policy before torch loads
from nexrl_fsdp.process_exit import exit_at_once
from nexrl_fsdp.worker.arguments import parse_arguments


def main() -> None:
    args = parse_arguments()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from nexrl_fsdp.direct_zmq.group_key import MissingGroupKey
    from nexrl_fsdp.worker import collective_check
    from nexrl_fsdp.worker.runtime import WorkerRank

    collective_check.install()
    try:
        rank = WorkerRank(args.api_server_url, args.identifier)
    except MissingGroupKey as error:
        sys.exit(f"python -m nexrl_fsdp.worker: {error}")
    try:
        rank.start()
        rank.serve()
    except Exception as error:
        rank.report_failure(error)
        raise
    finally:
        rank.close()
    exit_at_once()


if __name__ == "__main__":
    main()
