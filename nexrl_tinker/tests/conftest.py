"""Shared fixtures: a real TinkerCloud on 127.0.0.1 and the real tinker SDK.

No mocks: every test talks HTTP to a `TinkerService` started in-process (or, for the
restart test, to ``nexrl serve tinker`` in a subprocess) with the unmodified SDK or
raw httpx. One server per module keeps the suite fast on two cores.
"""

from __future__ import annotations

import os

# Worker ranks started by these tests check that each collective of NexRL's own code
# could run on a GPU run's process group (nexrl_fsdp.worker.collective_check): CI has no GPU.
os.environ.setdefault("NEXRL_CHECK_COLLECTIVES", "1")

os.environ.setdefault("TINKER_API_KEY", "tml-test")
os.environ["TINKER_TELEMETRY"] = "0"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from collections.abc import Iterator

import nexrl_engine  # noqa: F401 - its OpenMP wait policy, before anything loads torch

# isort: split

import pytest

from nexrl_grpo.option_cases import LOSS_OPTION_CASES
from nexrl_remote_api.testing import SdkHolderKit
from nexrl_service.testing import local_service_fixtures
from nexrl_tinker.holder import TinkerServiceHolder
from nexrl_tinker.holder_config import TinkerHolderConfig
from nexrl_tinker.testing import TEST_API_KEY, start_service

service, base_url, keyed_base_url = local_service_fixtures(start_service, "tinkercloud", TEST_API_KEY)


@pytest.fixture(scope="session")
def holder_kit() -> SdkHolderKit:
    """For the shared holder tests (`nexrl_remote_api.testing`)."""
    return SdkHolderKit(
        holder_class=TinkerServiceHolder, config_class=TinkerHolderConfig, api_key=TEST_API_KEY,
        scheme="tinker://", checkpoint_segment="weights", option_cases=LOSS_OPTION_CASES,
    )  # fmt: skip


@pytest.fixture(scope="module")
def service_client(base_url: str) -> Iterator[object]:
    import tinker

    client = tinker.ServiceClient(base_url=base_url)
    try:
        yield client
    finally:
        client.close("success").result(timeout=30)
