"""Tenants of the Tinker service on worker groups (``--workers 1 --max-worker-groups 4``).

Four tenants (four API keys) train at once, each model on its own one-rank group: every
optimizer step is applied once, to its own model only (each ends where an in-process
engine replaying that tenant's steps ends), and no tenant reaches another's model. A
fifth create is refused at once with a 429 naming the limit; a finished session stops
its group and frees its place; an expired one too. No group's process outlives the
service, whether it stops or is killed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from nexrl_core.config.adamw import AdamWSettings
from nexrl_engine import Datum, Engine
from nexrl_fsdp.worker_groups import group_identifier
from nexrl_tinker.testing import BASE_MODEL, start_service

pytestmark = pytest.mark.slow

TENANTS = 4
STEPS = 3


def adam(tenant: int) -> types.AdamParams:
    """Each tenant's own learning rate: a step applied to the wrong model shows."""
    return types.AdamParams(learning_rate=1e-3 * (tenant + 1), eps=1e-6, weight_decay=0.01, grad_clip_norm=1.0)


def tokens_of(tenant: int) -> list[int]:
    """Each tenant's own sequence."""
    return [3 + tenant, 40 + 7 * tenant, 100 + tenant, 17, 250 - tenant, 9 + 2 * tenant, 61]


def datum(tenant: int) -> types.Datum:
    tokens = tokens_of(tenant)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    svc = start_service(tmp_path_factory.mktemp("tenants"), workers=1, max_worker_groups=TENANTS)
    try:
        yield svc
    finally:
        svc.stop()


@pytest.fixture(scope="module")
def tenants(service: Any) -> Iterator[list[Any]]:
    clients = [tinker.ServiceClient(base_url=service.base_url, api_key=f"tml-tenant-{index}") for index in range(TENANTS)]
    try:
        yield clients
    finally:
        for client in clients:
            client.close("success").result(timeout=60)


def train_tenant(client: Any, tenant: int) -> dict[str, Any]:
    training = client.create_lora_training_client(base_model=BASE_MODEL, rank=0).result(timeout=600)
    steps = []
    for _ in range(STEPS):
        training.forward_backward([datum(tenant)], "cross_entropy").result(timeout=300)
        steps.append(training.optim_step(adam(tenant)).result(timeout=300).metrics["step:mean"])
    final = training.forward([datum(tenant)], "cross_entropy").result(timeout=300)
    return {"training": training, "steps": steps, "logprobs": final.loss_fn_outputs[0]["logprobs"].tolist()}


@pytest.fixture(scope="module")
def trained(tenants: list[Any]) -> list[dict[str, Any]]:
    with ThreadPoolExecutor(TENANTS) as pool:
        return list(pool.map(train_tenant, tenants, range(TENANTS)))


def replay(tenant: int) -> list[float]:
    """The tenant's steps on an in-process engine: where its model must end."""
    engine = Engine(model=BASE_MODEL, seed=0)
    tokens = tokens_of(tenant)
    one = Datum(input_tokens=tokens[:-1], loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    params = adam(tenant)
    settings = AdamWSettings(
        learning_rate=params.learning_rate,
        beta1=params.beta1,
        beta2=params.beta2,
        eps=params.eps,
        weight_decay=params.weight_decay,
        grad_clip_norm=params.grad_clip_norm,
    )
    for _ in range(STEPS):
        engine.forward_backward([one], "cross_entropy")
        engine.optim_step(settings)
    return engine.forward([one], "cross_entropy").outputs[0].logprobs


def test_every_tenant_gets_every_step_once_on_its_own_group(service: Any, trained: list[dict[str, Any]]) -> None:
    groups = [service.state.engines.training(run["training"].model_id) for run in trained]
    assert all(group is not None and group.ranks == 1 for group in groups)
    assert len({pid for group in groups for pid in group.rank_pids().values()}) == TENANTS  # a group each
    for tenant, run in enumerate(trained):
        assert run["steps"] == [float(step) for step in range(1, STEPS + 1)], f"tenant {tenant}'s step counts"
        np.testing.assert_allclose(run["logprobs"], replay(tenant), atol=1e-4, err_msg=f"tenant {tenant}")


def test_a_tenant_cannot_reach_another_tenants_model(service: Any, trained: list[dict[str, Any]]) -> None:
    with httpx.Client(base_url=service.base_url, headers={"X-API-Key": "tml-tenant-1"}, timeout=30) as other:
        response = other.post("/api/v1/get_info", json={"model_id": trained[0]["training"].model_id})
    assert response.status_code == 403 and "another" in response.json()["detail"]


def test_a_create_beyond_the_limit_is_refused_at_once(service: Any, trained: list[dict[str, Any]]) -> None:
    fifth = tinker.ServiceClient(base_url=service.base_url, api_key="tml-tenant-5")
    try:
        started = time.monotonic()
        with pytest.raises(tinker.RateLimitError, match=r"at most 4 worker groups.*--max-worker-groups 4"):
            fifth.create_lora_training_client(base_model=BASE_MODEL, rank=0).result(timeout=60)
        assert time.monotonic() - started < 15, "the refusal took as long as a retry loop"
    finally:
        fifth.close("success").result(timeout=60)


def test_a_finished_session_stops_its_group_and_frees_its_place(service: Any, tenants: list[Any], trained: list[dict[str, Any]]) -> None:
    pids = service.state.engines.training(trained[0]["training"].model_id).rank_pids()
    tenants[0].close("success").result(timeout=60)
    wait_gone(pids.values())
    newcomer = tinker.ServiceClient(base_url=service.base_url, api_key="tml-newcomer")
    try:
        training = newcomer.create_lora_training_client(base_model=BASE_MODEL, rank=0).result(timeout=600)
        assert training.forward([datum(0)], "cross_entropy").result(timeout=300).metrics["loss:sum"] > 0
    finally:
        newcomer.close("success").result(timeout=60)


@pytest.fixture
def expiring_service(tmp_path: Path) -> Iterator[Any]:
    """A service that expires a session 4 s after its last heartbeat (ample time for a new
    group's launcher to appear), and answers a poll within 0.5 s, so a client can heartbeat
    between polls."""
    svc = start_service(tmp_path, workers=1, stale_session_s=4.0, janitor_interval_s=0.5, long_poll_s=0.5)
    try:
        yield svc
    finally:
        svc.stop()


def create_model_raw(client: httpx.Client) -> tuple[str, str, str]:
    """A session and a full fine-tuning model made over plain HTTP; the session id, the
    model id and the creation's request id."""
    session_id = client.post("/api/v1/create_session", json={"tags": [], "sdk_version": "raw"}).json()["session_id"]
    created = client.post(
        "/api/v1/create_model",
        json={"session_id": session_id, "model_seq_id": 0, "base_model": BASE_MODEL, "lora_config": {"rank": 0}},
    ).json()
    return session_id, created["model_id"], created["request_id"]


def outcome_of(client: httpx.Client, request_id: str, heartbeat_session: str | None = None) -> dict[str, Any]:
    """The request's outcome once it has one, heartbeating ``heartbeat_session`` between
    polls when given (the service answers a poll within 0.5 s)."""
    while True:
        if heartbeat_session is not None:
            client.post("/api/v1/session_heartbeat", json={"session_id": heartbeat_session}).raise_for_status()
        outcome = client.post("/api/v1/retrieve_future", json={"request_id": request_id, "allow_metadata_only": False})
        if outcome.json().get("type") != "try_again":
            return outcome.json()


def test_an_expired_session_stops_its_group(expiring_service: Any) -> None:
    """A client that stops heartbeating: the janitor expires its session and its group ends."""
    with httpx.Client(base_url=expiring_service.base_url, headers={"X-API-Key": "tml-silent"}, timeout=60) as client:
        session_id, model_id, request_id = create_model_raw(client)
        outcome = outcome_of(client, request_id, heartbeat_session=session_id)
    assert outcome.get("model_id") == model_id, outcome
    pids = expiring_service.state.engines.training(model_id).rank_pids()
    wait_gone(pids.values())
    assert expiring_service.state.engines.training(model_id) is None


def test_a_session_that_expires_while_its_group_starts_leaves_no_group(expiring_service: Any) -> None:
    """The session expires while the model's group starts: the group's processes are held
    stopped (SIGSTOP) from the moment they appear until the janitor has expired the session,
    so the expiry lands inside the start however fast the machine. The group is stopped as
    soon as it is up, and the creation fails saying why."""
    with httpx.Client(base_url=expiring_service.base_url, headers={"X-API-Key": "tml-gone"}, timeout=60) as client:
        session_id, model_id, request_id = create_model_raw(client)
        held = hold_group_until(model_id, lambda: expiring_service.state.store.get_session(session_id).status == "expired")
        outcome = outcome_of(client, request_id)
    assert held, "the group's processes never appeared before the session expired"
    assert "released (its session ended) while it was being loaded" in str(outcome), outcome
    assert expiring_service.state.engines.training(model_id) is None
    wait_gone(held)


def hold_group_until(model_id: str, done: Callable[[], bool], within_s: float = 60) -> list[int]:
    """Stop (SIGSTOP) each process of the model's worker group as it appears until
    ``done()``, then let them all go on (SIGCONT); the pids held."""
    name = group_identifier(model_id)
    held: list[int] = []
    deadline = time.monotonic() + within_s
    try:
        while not done():
            assert time.monotonic() < deadline, f"not done within {within_s} s"
            for pid, command in descendants(os.getpid()).items():
                if pid not in held and "nexrl_fsdp.worker" in command and name in command:
                    os.kill(pid, signal.SIGSTOP)
                    held.append(pid)
            time.sleep(0.02)
    finally:
        for pid in held:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    return held


def test_no_process_outlives_the_killed_service(tmp_path: Path) -> None:
    """The service in a process of its own (as ``nexrl train`` embeds it): once it is
    killed outright, every process it started (torchrun, ranks, watchdogs) ends. (Stopped
    with SIGTERM, it ends them itself: tests/test_signals_real.py holds that within 10 s.)"""
    from nexrl_core.http.serving import ServeOptions
    from nexrl_tinker.server.service import TinkerService

    svc = TinkerService(ServeOptions(port=0, data_dir=str(tmp_path), workers=1, separate_process=True))
    svc.start()
    try:
        client = tinker.ServiceClient(base_url=svc.base_url, api_key="tml-owner")
        training = client.create_lora_training_client(base_model=BASE_MODEL, rank=0).result(timeout=600)
        training.forward([datum(0)], "cross_entropy").result(timeout=300)
        started = descendants(svc.pid)
        assert any("nexrl_fsdp.worker" in command for command in started.values()), started
        os.kill(svc.pid, signal.SIGKILL)
    finally:  # the session is still open
        svc.stop()
    # each rank's watchdog ends it once the service's workers API stops answering (30 s)
    wait_gone(started, within_s=90)


def descendants(root: int) -> dict[int, str]:
    """Every process below ``root``, with its command line."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found: dict[int, str] = {}
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), []):
            try:
                found[child] = (Path("/proc") / str(child) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            stack.append(child)
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_gone(pids: Any, within_s: float = 60.0) -> None:
    pids = list(pids)
    deadline = time.monotonic() + within_s
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.25)
    left = [pid for pid in pids if alive(pid)]
    assert not left, f"processes {left} outlived what started them"
