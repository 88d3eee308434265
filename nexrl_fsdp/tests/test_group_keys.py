"""Nothing of a worker group answers without the run's key: every ZMQ message carries a MAC
of the group's key (checked before anything of it is read), the workers' API wants the key
as a bearer token on every route but the health check, and ``nexrl serve workers`` will
not listen beyond the loopback without one. Each check is made against the real thing: a
uvicorn server, a rank group, a sampler process, the CLI."""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nexrl_core.http.serving import ServeOptions
from nexrl_fsdp.direct_zmq import wire
from nexrl_fsdp.direct_zmq.api_server import WorkersApiServer, create_app
from nexrl_fsdp.direct_zmq.group_key import ENV_WORKER_KEY, MAC_BYTES, bearer_header, new_group_key
from nexrl_fsdp.direct_zmq.launch import WorkerGroup
from nexrl_fsdp.direct_zmq.weights_inbox import WeightsInbox
from nexrl_fsdp.worker.runtime import WorkerRank
from nexrl_fsdp.worker.weights_push import SamplerPushError, push_weights
from nexrl_testing.fuzz import fuzz_app

from tests.conftest import ready_sampler, training_batch

KEY = new_group_key()
OTHER_KEY = new_group_key()
NEXRL = str(Path(sys.executable).with_name("nexrl"))
REGISTRY_CALLS = ("create", "report", "beat", "fail", "execute", "remove")
"""What a request can make the API server's registry do; a refused request does none of it."""
QUIET_S = 1.5
"""How long a socket that must not answer is watched."""


def _message() -> list[Any]:
    tensors = {"input_ids": torch.arange(12).view(3, 4), "loss_mask": torch.ones(3, 4), "empty": torch.zeros(0)}
    return wire.encode({"op": "update_actor", "op_id": "m1", "options": {}}, tensors, key=KEY)


# --- the wire ---------------------------------------------------------------------------------


def test_a_message_ends_with_its_mac_and_decodes_with_the_key() -> None:
    frames = _message()
    assert len(frames) == 5 and len(frames[-1]) == MAC_BYTES, "header, three tensors, the MAC"
    message = wire.decode([bytes(memoryview(frame)) for frame in frames], key=KEY)
    assert message.header["op_id"] == "m1" and torch.equal(message.tensors["input_ids"], torch.arange(12).view(3, 4))


@pytest.mark.parametrize("index", range(5), ids=["header", "input_ids", "loss_mask", "empty-tensor", "mac"])
def test_a_changed_byte_in_any_frame_is_unauthenticated(index: int) -> None:
    frames = [bytearray(memoryview(frame)) for frame in _message()]
    if frames[index]:
        frames[index][len(frames[index]) // 2] ^= 0x01
    else:
        frames[index] = bytearray(b"\0")  # an empty frame changed is a frame with a byte
    with pytest.raises(wire.UnauthenticatedMessage, match="lacks the run's key"):
        wire.decode(frames, key=KEY)


def test_a_message_without_its_mac_or_with_another_keys_is_unauthenticated() -> None:
    frames = [bytes(memoryview(frame)) for frame in _message()]
    for unauthenticated in (frames[:-1], frames[:1], [], wire.encode({"op": "barrier"}, key=OTHER_KEY)):
        with pytest.raises(wire.UnauthenticatedMessage, match="lacks the run's key"):
            wire.decode(unauthenticated, key=KEY)


def test_frames_cannot_be_cut_differently_under_the_same_mac() -> None:
    """Two tensor frames merged into one (or a byte moved from one frame to the next) keep
    every byte and their order, but not the frame lengths the MAC binds in."""
    header, first, second, *rest = [
        bytes(memoryview(frame)) for frame in wire.encode({"kind": "x"}, {"a": torch.ones(2), "b": torch.ones(2)}, key=KEY)
    ]
    mac = rest[-1]
    for recut in ([header, first + second, mac], [header, first[:-1], first[-1:] + second, mac], [header + first, second, mac]):
        with pytest.raises(wire.UnauthenticatedMessage):
            wire.decode(recut, key=KEY)


def test_the_mac_is_checked_before_anything_is_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the header of an unauthenticated message was parsed")

    monkeypatch.setattr(wire.json, "loads", refuse)
    with pytest.raises(wire.UnauthenticatedMessage):
        wire.decode([b'{"kind": "x", "tensors": []}', b"\0" * MAC_BYTES], key=KEY)


def test_a_rank_drops_a_command_without_the_key(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The command channel: a command whose MAC is not the key's is dropped and logged, one
    the API server signs is taken."""
    monkeypatch.setenv(ENV_WORKER_KEY, KEY)
    rank = WorkerRank("http://127.0.0.1:9", "g")
    push = rank.context.socket(zmq.PUSH)
    rank.commands = rank.context.socket(zmq.PULL)
    try:
        port = rank.commands.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        command = [b"g", json.dumps({"kind": "execute", "op_id": "x", "op": "barrier"}).encode()]
        push.send_multipart(command)
        push.send_multipart(wire.add_mac(command, OTHER_KEY))
        push.send_multipart(wire.add_mac(command, KEY))
        with caplog.at_level(logging.WARNING, logger="nexrl_fsdp.worker"):
            assert rank._command() is None and rank._command() is None
        assert [record.message.count("dropped a command") for record in caplog.records] == [1, 1]
        assert rank._command() == {"kind": "execute", "op_id": "x", "op": "barrier"}
    finally:
        push.close(linger=0)
        rank.close()


def test_a_rank_started_without_the_key_exits_naming_it() -> None:
    env = {name: value for name, value in os.environ.items() if name != ENV_WORKER_KEY}
    done = subprocess.run(
        [sys.executable, "-m", "nexrl_fsdp.worker", "--api-server-url", "http://127.0.0.1:9", "--identifier", "g"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 1 and f"set {ENV_WORKER_KEY}" in done.stderr and "Traceback" not in done.stderr, done.stderr


# --- the workers' API -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[WorkersApiServer]:
    started = WorkersApiServer(ServeOptions(port=0), key=KEY, dead_after_s=3600)
    started.start()
    try:
        yield started
    finally:
        started.stop()


class RegistrySpy:
    """Counts every call a request makes on the registry (the calls still happen)."""

    def __init__(self, server: WorkersApiServer, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        registry = server.registry
        for name in REGISTRY_CALLS:
            original = getattr(registry, name)

            def spy(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
                self.calls.append(_name)
                return _original(*args, **kwargs)

            monkeypatch.setattr(registry, name, spy)


@pytest.fixture
def spy(server: WorkersApiServer, monkeypatch: pytest.MonkeyPatch) -> RegistrySpy:
    return RegistrySpy(server, monkeypatch)


@pytest.fixture
def ready_group(server: WorkersApiServer) -> Iterator[str]:
    """A group whose one rank has reported, so an execute would publish."""
    identifier = f"g{uuid.uuid4().hex[:8]}"
    with httpx.Client(base_url=f"{server.base_url}/api/v1", headers=bearer_header(KEY), timeout=10) as client:
        assert client.post("/groups", json={"identifier": identifier, "world_size": 1}).status_code == 200
        report = {"rank": 0, "endpoint": "tcp://127.0.0.1:1", "pid": 1}
        assert client.post(f"/groups/{identifier}/workers", json=report).json()["status"] == "ready"
        yield identifier
        client.delete(f"/groups/{identifier}")


def _routes(identifier: str) -> list[tuple[str, str, dict[str, Any] | None]]:
    """Every route but the health check (and one no route serves), with a valid body."""
    group = f"/api/v1/groups/{identifier}"
    return [
        ("POST", "/api/v1/groups", {"identifier": "intruder", "world_size": 1}),
        ("GET", group, None),
        ("POST", f"{group}/workers", {"rank": 0, "endpoint": "tcp://10.9.9.9:1", "pid": 2}),
        ("POST", f"{group}/heartbeat", {"rank": 0}),
        ("POST", f"{group}/failed", {"rank": 0, "error": "forged"}),
        ("POST", f"{group}/execute", {"op_id": "forged", "op": "destroy"}),
        ("DELETE", group, None),
        ("GET", "/openapi.json", None),
        ("GET", "/api/v1/no-such-route", None),
    ]


WRONG_AUTHORIZATIONS = {
    "none": {},
    "wrong-key": bearer_header(OTHER_KEY),
    "key-without-bearer": {"authorization": KEY},
    "basic": {"authorization": f"Basic {KEY}"},
    "key-with-a-suffix": bearer_header(KEY + "x"),
    "bare-bearer": {"authorization": "Bearer"},
}


@pytest.mark.parametrize("headers", list(WRONG_AUTHORIZATIONS.values()), ids=list(WRONG_AUTHORIZATIONS))
def test_every_route_without_the_key_is_refused_and_nothing_of_it_runs(
    server: WorkersApiServer, ready_group: str, spy: RegistrySpy, headers: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    assert server.registry is not None
    before = server.registry.get(ready_group).info()
    with caplog.at_level(logging.WARNING, logger="nexrl_fsdp.workers_api"), httpx.Client(base_url=server.base_url, timeout=10) as client:
        for method, path, body in _routes(ready_group):
            response = client.request(method, path, json=body, headers=headers)
            assert response.status_code == 401, (method, path, response.status_code, response.text)
            assert "Authorization: Bearer" in response.json()["detail"] and response.headers["www-authenticate"] == "Bearer"
    assert spy.calls == [], f"a refused request reached the registry: {spy.calls}"
    assert server.registry.get(ready_group).info() == before and "intruder" not in server.registry.groups
    refusals = [record.getMessage() for record in caplog.records if "refused" in record.getMessage()]
    assert len(refusals) == len(_routes(ready_group)) and all("from 127.0.0.1:" in line for line in refusals), refusals
    assert f"/api/v1/groups/{ready_group}/execute" in " ".join(refusals)


def test_the_health_check_is_open_and_the_key_opens_the_rest(server: WorkersApiServer, ready_group: str, spy: RegistrySpy) -> None:
    assert httpx.get(f"{server.base_url}/api/v1/healthz", timeout=10).json() == {"status": "ok"}
    with httpx.Client(base_url=server.base_url, headers=bearer_header(KEY), timeout=10) as client:
        assert client.get(f"/api/v1/groups/{ready_group}").json()["status"] == "ready"
        assert client.post(f"/api/v1/groups/{ready_group}/heartbeat", json={"rank": 0}).json() == {"status": "ready"}
    assert spy.calls == ["beat"]


def test_the_commands_the_server_publishes_carry_the_keys_mac(server: WorkersApiServer, ready_group: str) -> None:
    assert server.registry is not None
    context = zmq.Context()
    subscriber = context.socket(zmq.SUB)
    try:
        subscriber.setsockopt(zmq.SUBSCRIBE, ready_group.encode())
        subscriber.connect(server.registry.get(ready_group).command_endpoint)
        assert subscriber.poll(10_000), "no hello within 10 s"
        frames = subscriber.recv_multipart()
        topic, body = wire.verify_mac(frames, KEY)
        assert topic == ready_group.encode() and json.loads(body) == {"kind": "hello"}
        with pytest.raises(wire.UnauthenticatedMessage):
            wire.verify_mac(frames, OTHER_KEY)
    finally:
        subscriber.close(linger=0)
        context.term()


@given(authorization=st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=80).map(str.strip))
@settings(max_examples=60, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
def test_no_generated_authorization_opens_the_api(server: WorkersApiServer, authorization: str) -> None:
    """Whatever the header holds, but the key, the answer is 401 and no group is made."""
    response = httpx.post(
        f"{server.base_url}/api/v1/groups",
        json={"identifier": "guessed", "world_size": 1},
        headers={"authorization": authorization},
        timeout=10,
    )
    assert response.status_code == 401
    assert server.registry is not None and "guessed" not in server.registry.groups


@pytest.mark.parametrize("headers", [WRONG_AUTHORIZATIONS["none"], WRONG_AUTHORIZATIONS["wrong-key"]], ids=["no-key", "wrong-key"])
def test_fuzzing_every_route_without_the_key_runs_nothing_and_fails_nothing(
    server: WorkersApiServer, ready_group: str, spy: RegistrySpy, headers: dict[str, str]
) -> None:
    """Generated requests (valid and schema-breaking) to every route, aimed at a ready
    group: none answers 5xx, none reaches the registry (zero executed), and only the
    health check answers anything but 401."""
    assert server.registry is not None

    def aim_at_the_group(case: Any) -> None:
        if "identifier" in (case.path_parameters or {}):
            case.path_parameters["identifier"] = ready_group

    report = fuzz_app(
        create_app(server.registry, KEY).openapi(), server.base_url, headers=headers, max_examples=8, on_case=aim_at_the_group
    )
    print(f"workers API without the key: {report.summary()}")
    assert not report.server_errors and not report.hangs, report.server_errors + report.hangs
    assert spy.calls == [], f"a request without the key reached the registry: {spy.calls}"
    assert set(report.statuses) <= {200, 401} and report.statuses[401] > report.statuses[200], report.statuses
    assert server.registry.get(ready_group).status == "ready"


# --- nexrl serve workers ------------------------------------------------------------------------


def _stderr_lines(process: subprocess.Popen[str]) -> queue.Queue[str]:
    """The process's stderr lines as they come ("" once it closes), read on a thread, so a
    test waits for each with a deadline instead of hanging on a server that says nothing."""
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert process.stderr is not None
        for line in iter(process.stderr.readline, ""):
            lines.put(line)
        lines.put("")

    threading.Thread(target=read, daemon=True).start()
    return lines


def test_serve_workers_beyond_the_loopback_refuses_to_start_without_a_key() -> None:
    """Refused in one line naming both ways to give a key (a server that starts anyway is
    stopped as soon as it says it serves)."""
    env = {name: value for name, value in os.environ.items() if name != ENV_WORKER_KEY}
    server = subprocess.Popen([NEXRL, "serve", "workers", "--host", "0.0.0.0", "--port", "0"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        said, lines = _stderr_lines(server), []
        while line := said.get(timeout=30):
            if line.startswith("NexRL workers API"):  # it serves (or is about to): stop it now
                server.terminate()
            lines.append(line)
        assert server.wait(timeout=30) == 2, lines
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert len(lines) == 1 and "--api-key" in lines[0] and ENV_WORKER_KEY in lines[0] and "0.0.0.0" in lines[0], lines


def test_serve_workers_on_the_loopback_without_a_key_makes_one_and_says_so() -> None:
    """The printed key is the one the server checks."""
    env = {name: value for name, value in os.environ.items() if name != ENV_WORKER_KEY}
    server = subprocess.Popen([NEXRL, "serve", "workers", "--port", "0"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        said = _stderr_lines(server)
        told = said.get(timeout=30)
        assert f"{ENV_WORKER_KEY}=" in told, told
        serving = said.get(timeout=30)
        assert "serving at" in serving, serving
        key = told.strip().rsplit(f"{ENV_WORKER_KEY}=", 1)[1]
        url = serving.strip().rsplit(" ", 1)[1]
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{url}/api/v1/healthz", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and server.poll() is None
                time.sleep(0.1)
        assert httpx.post(f"{url}/api/v1/groups", json={"identifier": "g", "world_size": 1}, timeout=10).status_code == 401
        assert (
            httpx.post(
                f"{url}/api/v1/groups", json={"identifier": "g", "world_size": 1}, headers=bearer_header(key), timeout=10
            ).status_code
            == 200
        )
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_a_key_given_to_the_server_is_the_one_it_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """From ``--api-key`` or the environment: the server uses it and makes none of its own."""
    monkeypatch.setenv(ENV_WORKER_KEY, KEY)
    assert WorkersApiServer(ServeOptions(port=0)).key == KEY and not WorkersApiServer(ServeOptions(port=0)).generated_key
    assert WorkersApiServer(ServeOptions(port=0, api_key=OTHER_KEY)).key == OTHER_KEY
    assert WorkersApiServer(ServeOptions(host="0.0.0.0", port=0, api_key=OTHER_KEY)).key == OTHER_KEY


# --- weights pushed to an inbox or a sampler process ---------------------------------------------


def test_an_inbox_drops_weights_without_the_key() -> None:
    loads: list[dict[str, torch.Tensor]] = []
    weights = {"w": torch.ones(3)}
    with WeightsInbox(lambda received: loads.append({name: tensor.clone() for name, tensor in received.items()}), key=KEY) as inbox:
        context = zmq.Context()
        try:
            with pytest.raises(SamplerPushError, match="did not answer"):
                push_weights(context, inbox.endpoint, {"w": torch.zeros(3)}, "forged", timeout_s=QUIET_S, key=OTHER_KEY)
            assert loads == []
            push_weights(context, inbox.endpoint, weights, "real", timeout_s=30, key=KEY)
        finally:
            context.term()
    assert len(loads) == 1 and torch.equal(loads[0]["w"], weights["w"])


@pytest.mark.slow
def test_a_sampler_process_answers_nothing_without_the_key(tmp_path: Path) -> None:
    """Not even ``close``: a message without the key is dropped (and logged), and the
    process serves the driver as before."""
    with ready_sampler(tmp_path, KEY) as (sampler, endpoint):
        context = zmq.Context()
        foreign = context.socket(zmq.DEALER)
        try:
            foreign.connect(endpoint)
            wire.send(foreign, {"kind": "close", "id": 1}, key=OTHER_KEY)
            foreign.send_multipart([json.dumps({"kind": "close", "id": 2, "tensors": []}).encode()])
            assert not foreign.poll(int(QUIET_S * 1000)), "the sampler answered a message without the key"
        finally:
            foreign.close(linger=0)
            context.term()
        assert sampler.alive() and sampler.request({"kind": "info"}).header["pid"] == sampler.pid
        assert sampler.log_tail().count("sampler: dropped a message") == 2


# --- a real rank group ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerGroup]:
    """One rank on nexrl-tiny, beating every 0.5 s and dead after 3 s of silence: a
    watchdog whose beats were refused would end it within the module."""
    workers = WorkerGroup(1, tmp_path_factory.mktemp("keys") / "workers.log", heartbeat_s=0.5, dead_after_s=3, op_timeout_s=120)
    try:
        workers.transport.init_model("nexrl-tiny", dtype="float32", seed=0)
        yield workers
    finally:
        workers.stop()


@pytest.mark.slow
def test_a_foreign_dealer_on_rank_0s_data_socket_is_neither_acknowledged_nor_run(group: WorkerGroup, tmp_path: Path) -> None:
    """Someone who reaches rank 0's data port sends a ``save_checkpoint`` without the key,
    with another key, and with no MAC at all. Rank 0 answers none of them and stores none:
    even when the op ids are then executed (through the API, with the key, as though the
    driver had done it), nothing is written. The group then works for its driver."""
    endpoint = group.transport.group_info["endpoints"]["0"]
    forged = {f"forged-{n}": tmp_path / f"written-{n}" for n in range(2)}
    context = zmq.Context()
    foreign = context.socket(zmq.DEALER)
    try:
        foreign.connect(endpoint)
        (first, first_path), (second, second_path) = forged.items()
        wire.send(foreign, {"op": "save_checkpoint", "op_id": first, "options": {"path": str(first_path)}}, key=OTHER_KEY)
        foreign.send_multipart(
            [json.dumps({"op": "save_checkpoint", "op_id": second, "options": {"path": str(second_path)}, "tensors": []}).encode()]
        )
        assert not foreign.poll(int(QUIET_S * 1000)), "rank 0 answered a message without the key"
        for op_id in forged:
            group.transport._execute("save_checkpoint", op_id)
        group.transport.barrier()  # after the executes: every rank has run them
    finally:
        foreign.close(linger=0)
        context.term()
    assert [path for path in forged.values() if path.exists()] == [], "an op without the key was run"
    assert group.log_tail().count("rank 0: dropped a data message") == 2
    assert group.transport.compute_log_prob(training_batch()).shape == training_batch().tensors["input_ids"].shape
    assert group.transport.info()["status"] == "ready", "the ranks' watchdogs beat with the key"


@pytest.mark.slow
def test_the_ranks_api_calls_carry_the_key(group: WorkerGroup, caplog: pytest.LogCaptureFixture) -> None:
    """The rank and its watchdog reported and beat through the keyed API (the group is
    ready, beating), and nothing of the group was refused."""
    with caplog.at_level(logging.WARNING, logger="nexrl_fsdp.workers_api"):
        time.sleep(1.5)  # three heartbeats
        assert group.transport.info()["status"] == "ready"
    assert not [record for record in caplog.records if "refused" in record.getMessage()]
