"""What the tests of every local service share: starting one, and its pytest fixtures.

Each protocol's tests (the Tinker and Weaver distributions', and other distributions'
end-to-end tests through their ``testing`` modules) start the real server on 127.0.0.1
the same way, so it is written once here; nothing mocks anything. Imported by tests only:
it needs pytest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from nexrl_core.http.serving import ServeOptions
from nexrl_service.server import LocalService

__all__ = ["CLIENT_STEPS", "ClientsAtOnceContract", "local_service_fixtures", "start_local_service"]

CLIENTS = 16
CLIENT_STEPS = 3
"""Optimizer steps each of `ClientsAtOnceContract`'s clients takes."""


def start_local_service(
    service_class: type[LocalService],
    data_dir: str | Path,
    *,
    api_key: str | None = None,
    db: str | None = None,
    workers: int = 0,
    max_worker_groups: int = 4,
    device: str = "cpu",
    **overrides: Any,
) -> LocalService:
    """A started ``service_class`` on a free port (stop it with ``.stop()``); ``workers`` > 0
    trains each model on its own worker group of that many ranks; ``device`` is where its
    own engines live; ``overrides`` are `nexrl_service.settings.ServerSettings` fields."""
    options = ServeOptions(
        port=0,
        data_dir=str(data_dir),
        api_key=api_key,
        db=db,
        workers=workers,
        max_worker_groups=max_worker_groups,
        device=device,
    )
    service = service_class(options, **overrides)
    service.start()
    return service


def local_service_fixtures(start: Callable[..., LocalService], name: str, api_key: str) -> tuple[Any, Any, Any]:
    """The ``service``, ``base_url`` and ``keyed_base_url`` fixtures of a protocol's tests
    (bind them in its ``conftest.py`` under those names): one service per test module,
    which keeps a suite fast on two cores, and one that checks ``api_key`` as the
    embedded service does. ``start`` is the protocol's `start_local_service`; ``name``
    names their data directories."""

    @pytest.fixture(scope="module", name="service")
    def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalService]:
        svc = start(tmp_path_factory.mktemp(name))
        try:
            yield svc
        finally:
            svc.stop()

    @pytest.fixture(scope="module", name="base_url")
    def base_url(service: LocalService) -> str:
        assert service.base_url is not None
        return service.base_url

    @pytest.fixture(scope="module", name="keyed_base_url")
    def keyed_base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
        """A service that checks the API key, as the embedded one does."""
        svc = start(tmp_path_factory.mktemp(f"keyed-{name}"), api_key=api_key)
        try:
            assert svc.base_url is not None
            yield svc.base_url
        finally:
            svc.stop()

    return service, base_url, keyed_base_url


class ClientsAtOnceContract:
    """Sixteen SDK clients at once on one service, on SQLite and on PostgreSQL (``sql_url``):
    every operation is answered exactly once, nothing is lost or applied twice. A subclass
    gives `start_service` and `one_client`, the protocol's side."""

    def start_service(self, data_dir: Path, **options: Any) -> LocalService:
        """The protocol's `start_local_service`."""
        raise NotImplementedError

    def one_client(self, base_url: str, index: int) -> tuple[list[float], list[int], str]:
        """Trains its own model `CLIENT_STEPS` times and samples once through the SDK;
        returns the optimizer step counter after each step, the sample's tokens, and its
        model id."""
        raise NotImplementedError

    @pytest.fixture
    def base_url(self, tmp_path: Path, sql_url: str) -> Iterator[str]:
        service = self.start_service(tmp_path / "data", db=sql_url)
        try:
            assert service.base_url is not None
            yield service.base_url
        finally:
            service.stop()

    @pytest.mark.slow
    def test_sixteen_clients_at_once(self, base_url: str) -> None:
        with ThreadPoolExecutor(CLIENTS) as pool:
            results = list(pool.map(lambda index: self.one_client(base_url, index), range(CLIENTS)))
        for counters, sample, _ in results:
            assert counters == [float(step) for step in range(1, CLIENT_STEPS + 1)], "an optimizer step was lost or applied twice"
            assert 0 < len(sample) <= 3
        assert len({model_id for _, _, model_id in results}) == CLIENTS
