"""The two-node Ray cluster fixture, and the environment the tinker SDK and the ranks need offline."""

from __future__ import annotations

import os

# Ranks check that each collective of NexRL's own code could run on a GPU run's process group (CI has no GPU).
os.environ.setdefault("NEXRL_CHECK_COLLECTIVES", "1")
os.environ.setdefault("TINKER_API_KEY", "tml-test")
os.environ["TINKER_TELEMETRY"] = "0"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from nexrl_ray.testing import ray_cluster  # noqa: E402,F401 - the fixture
