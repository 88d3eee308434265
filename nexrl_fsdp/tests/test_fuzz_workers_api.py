"""The workers' API server fuzzed through its own OpenAPI schema, and the requests that
once took it down refused by name.

A run's driver and ranks are its only clients, but it listens on a port: nothing a
request carries may answer 5xx, hang, or make the server allocate without bound. The
fuzzer holds the key here, so its requests reach the routes (`test_group_keys` fuzzes
without it).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from nexrl_core.http.serving import ServeOptions
from nexrl_fsdp.direct_zmq.api_server import MAX_WORLD_SIZE, WorkersApiServer, create_app
from nexrl_fsdp.direct_zmq.group_key import bearer_header, new_group_key
from nexrl_testing.fuzz import fuzz_app

MAX_EXAMPLES = 40
"""Generated requests per operation and mode (valid, schema-breaking)."""


@pytest.fixture(scope="module")
def server() -> Iterator[WorkersApiServer]:
    started = WorkersApiServer(ServeOptions(port=0), key=new_group_key())
    started.start()
    try:
        yield started
    finally:
        started.stop()


def api(server: WorkersApiServer) -> httpx.Client:
    return httpx.Client(base_url=f"{server.base_url}/api/v1", headers=bearer_header(server.key), timeout=10)


def test_a_world_size_no_cluster_has_is_refused_by_name(server: WorkersApiServer) -> None:
    with api(server) as client:
        response = client.post("/groups", json={"identifier": "huge", "world_size": 10**9})
        assert response.status_code == 422 and "world_size" in response.text and str(MAX_WORLD_SIZE) in response.text
        assert client.get("/groups/huge").status_code == 404, "a refused group is not registered"


def test_booleans_are_not_integers(server: WorkersApiServer) -> None:
    with api(server) as client:
        assert client.post("/groups", json={"identifier": "flags", "world_size": True}).status_code == 422
        assert client.post("/groups", json={"identifier": "flags", "world_size": 2}).status_code == 200
        response = client.post("/groups/flags/heartbeat", json={"rank": False})
        assert response.status_code == 422 and "rank" in response.text
        client.delete("/groups/flags")


def test_no_request_fails_the_server(server: WorkersApiServer) -> None:
    report = fuzz_app(
        create_app(server.registry, server.key).openapi(), server.base_url, headers=bearer_header(server.key), max_examples=MAX_EXAMPLES
    )
    print(f"workers API: {report.summary()}")
    assert not report.server_errors, "\n".join(report.server_errors)
    assert not report.hangs, report.hangs
    assert httpx.get(f"{server.base_url}/api/v1/healthz", timeout=10).json() == {"status": "ok"}


def test_a_group_created_used_and_removed_under_fuzzing(server: WorkersApiServer) -> None:
    """The stateful sequence: a real group, every route fuzzed with its identifier, then
    removed; the server still creates groups afterwards."""
    with api(server) as client:
        assert client.post("/groups", json={"identifier": "fuzzed", "world_size": 2}).status_code == 200

        def aim_at_the_group(case: object) -> None:
            if "identifier" in (case.path_parameters or {}):  # type: ignore[attr-defined]
                case.path_parameters["identifier"] = "fuzzed"  # type: ignore[attr-defined]

        report = fuzz_app(
            create_app(server.registry, server.key).openapi(),
            server.base_url,
            headers=bearer_header(server.key),
            max_examples=MAX_EXAMPLES // 2,
            on_case=aim_at_the_group,
        )
        print(f"workers API, one live group: {report.summary()}")
        assert not report.server_errors, "\n".join(report.server_errors)
        assert not report.hangs, report.hangs
        client.delete("/groups/fuzzed")
        assert client.post("/groups", json={"identifier": "after", "world_size": 1}).status_code == 200
