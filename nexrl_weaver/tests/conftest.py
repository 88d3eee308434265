"""Shared fixtures: a real local Weaver service on 127.0.0.1 and the real nex-weaver SDK.

No mocks: every test talks HTTP to a `WeaverService` started in-process (or, for the
restart test, ``nexrl serve weaver`` in a subprocess) with the unmodified SDK or raw
httpx. One server per module keeps the suite fast on two cores.
"""

from __future__ import annotations

import os

# Worker ranks started by these tests check that each collective of NexRL's own code
# could run on a GPU run's process group (nexrl_fsdp.worker.collective_check): CI has no GPU.
os.environ.setdefault("NEXRL_CHECK_COLLECTIVES", "1")

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WEAVER_OPERATION_POLL_INTERVAL", "0.05")
os.environ.pop("WEAVER_API_KEY", None)
os.environ.pop("WEAVER_BASE_URL", None)
os.environ.pop("WEAVER_TENSOR_TRANSPORT", None)

import nexrl_engine  # noqa: F401 - its OpenMP wait policy, before anything loads torch

# isort: split

import pytest

from nexrl_grpo.option_cases import LOSS_OPTION_CASES
from nexrl_remote_api.testing import SdkHolderKit
from nexrl_service.testing import local_service_fixtures
from nexrl_weaver.holder import WeaverServiceHolder
from nexrl_weaver.holder_config import WeaverHolderConfig
from nexrl_weaver.testing import TEST_API_KEY, start_service

service, base_url, keyed_base_url = local_service_fixtures(start_service, "weaver", TEST_API_KEY)


@pytest.fixture(scope="session")
def holder_kit() -> SdkHolderKit:
    """For the shared holder tests (`nexrl_remote_api.testing`)."""
    return SdkHolderKit(
        holder_class=WeaverServiceHolder, config_class=WeaverHolderConfig, api_key=TEST_API_KEY,
        scheme="weaver://", checkpoint_segment="checkpoints", option_cases=LOSS_OPTION_CASES,
    )  # fmt: skip
