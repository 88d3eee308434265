"""Worker ranks started by these tests check that each collective of NexRL's own code could
run on a GPU run's process group (nexrl_fsdp.worker.collective_check): CI has no GPU."""

from __future__ import annotations

import os

os.environ.setdefault("NEXRL_CHECK_COLLECTIVES", "1")
