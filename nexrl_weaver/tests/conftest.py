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
for _name in ("WEAVER_API_KEY", "WEAVER_BASE_URL", "WEAVER_TENSOR_TRANSPORT"):
    os.environ.pop(_name, None)

from collections.abc import Iterator

import nexrl_engine  # noqa: F401 - its OpenMP wait policy, before anything loads torch

import pytest
from nexrl_weaver.testing import TEST_API_KEY, start_service


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    svc = start_service(tmp_path_factory.mktemp("weaver"))
    try:
        yield svc
    finally:
        svc.stop()


@pytest.fixture(scope="module")
def base_url(service) -> str:
    return service.base_url


@pytest.fixture(scope="module")
def keyed_base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A service that checks the API key (``TEST_API_KEY``), as the embedded one does."""
    svc = start_service(tmp_path_factory.mktemp("keyed-weaver"), api_key=TEST_API_KEY)
    try:
        yield svc.base_url
    finally:
        svc.stop()
