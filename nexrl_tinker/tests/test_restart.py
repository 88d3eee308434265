"""``kill -9`` the server mid-request, restart it on the same database (SQLite and
PostgreSQL): nothing hangs,
saved state loads, sessions are listed, idle models are rebuilt on first use; a model on
a worker group comes back with every optimizer step its client was answered."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from nexrl_tinker.testing import BASE_MODEL, free_port, wait_healthy

GROUP_SAVE_EVERY = 2
"""A group model's whole state is saved every this many optimizer steps; the steps in
between come back from its journal."""


class ServerProcess:
    """``nexrl serve tinker`` in a subprocess, restartable on the same port and database."""

    def __init__(self, tmp_path: Path, db: str, extra: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data_dir = tmp_path / "data"
        self.db = db
        self.extra = extra
        """More ``nexrl serve tinker`` options."""
        self.log = tmp_path / "server.log"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        nexrl = Path(sys.executable).with_name("nexrl")
        command = [str(nexrl), "serve", "tinker", "--port", str(self.port), "--db", self.db, "--data-dir", str(self.data_dir), *self.extra]
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
        wait_healthy(self.url, timeout=120)

    def kill9(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture
def server(tmp_path: Path, sql_url: str) -> Iterator[ServerProcess]:
    """The service on a fresh SQLite file, then on a fresh PostgreSQL database."""
    proc = ServerProcess(tmp_path, sql_url)
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


@pytest.mark.slow
# SQLite only: a kill -9 of the service cannot touch what a separate PostgreSQL server has
# committed; what the test proves (each answer committed before it is sent, WAL kept) is
# the in-process store's, and PostgreSQL's dialect is covered by the store and concurrency tests.
@pytest.mark.parametrize("sql_url", ["sqlite"], indirect=True)
def test_kill_9_and_restart(server: ServerProcess) -> None:
    small = [datum([19, 20, 13, 21, 22, 31, 22, 24, 5, 7])]
    big = [datum([(7 * i + j) % 50 + 3 for j in range(256)]) for i in range(32)]

    old_client = tinker.ServiceClient(base_url=server.url)
    old_session = old_client.holder.get_session_id()
    idle = old_client.create_lora_training_client(base_model=BASE_MODEL, rank=4).result(timeout=120)
    idle.forward_backward(small, "cross_entropy").result(timeout=120)
    idle.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=120)
    saved = idle.save_state("before-kill").result(timeout=120).path
    loss_at_save = idle.forward(small, "cross_entropy").result(timeout=120).metrics["loss:sum"]

    busy = old_client.create_lora_training_client(base_model=BASE_MODEL, rank=4).result(timeout=120)
    in_flight = [busy.forward_backward(big, "cross_entropy") for _ in range(3)]
    with httpx.Client(base_url=server.url, timeout=10) as http:
        deadline = time.monotonic() + 60
        while http.get("/api/v1/healthz").json()["requests_in_flight"] < 1:
            assert time.monotonic() < deadline, "the big requests never reached the server"
            time.sleep(0.02)
    server.kill9()
    server.start()

    # The futures that were in flight fail with a message instead of hanging.
    with pytest.raises(tinker.RequestFailedError, match="restarted"):
        in_flight[0].result(timeout=120)

    # State saved before the kill loads in a new client; sessions survived.
    with tinker.ServiceClient(base_url=server.url) as new_client:
        resumed = new_client.create_training_client_from_state(saved).result(timeout=120)
        loss_resumed = resumed.forward(small, "cross_entropy").result(timeout=120).metrics["loss:sum"]
        assert loss_resumed == pytest.approx(loss_at_save, rel=1e-5)
        rest = tinker.RestClient(base_url=server.url)
        sessions = rest.list_sessions().result(timeout=30).sessions
        assert old_session in sessions and new_client.holder.get_session_id() in sessions
        details = rest.get_session(old_session).result(timeout=30)
        assert idle.model_id in details.training_run_ids and busy.model_id in details.training_run_ids
        run = rest.get_training_run(idle.model_id).result(timeout=30)
        assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == saved

    # The idle training client of the old process goes on: its engine is rebuilt from its last save.
    loss_rebuilt = idle.forward(small, "cross_entropy").result(timeout=120).metrics["loss:sum"]
    assert loss_rebuilt == pytest.approx(loss_at_save, rel=1e-5)
    idle.forward_backward(small, "cross_entropy").result(timeout=120)
    idle.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=120)
    old_client.close("success").result(timeout=30)
    assert "Traceback" not in server.log.read_text()


@pytest.fixture
def group_server(tmp_path: Path) -> Iterator[ServerProcess]:
    """The service training each model on its own worker group of one rank, saving its
    whole state every second optimizer step."""
    proc = ServerProcess(
        tmp_path, f"sqlite:///{tmp_path / 'tinker.db'}", extra=("--workers", "1", "--worker-save-every", str(GROUP_SAVE_EVERY))
    )
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.mark.slow
def test_kill_9_of_a_service_on_worker_groups_keeps_every_answered_optimizer_step(group_server: ServerProcess) -> None:
    """The client never saved: the group saved its state after the second optimizer step
    and journaled the third step's calls; the restarted service rebuilds the model's
    group from that state and the journal."""
    small = [datum([19, 20, 13, 21, 22, 31, 22, 24, 5, 7])]
    client = tinker.ServiceClient(base_url=group_server.url)
    training = client.create_lora_training_client(base_model=BASE_MODEL, rank=0).result(timeout=300)
    first = training.forward(small, "cross_entropy").result(timeout=120).metrics["loss:sum"]
    for _ in range(3):
        training.forward_backward(small, "cross_entropy").result(timeout=120)
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=120)
    trained = training.forward(small, "cross_entropy").result(timeout=120).metrics["loss:sum"]
    assert trained < first * 0.9

    group_server.kill9()
    group_server.start()
    assert training.forward(small, "cross_entropy").result(timeout=300).metrics["loss:sum"] == pytest.approx(trained, rel=1e-5)
    training.forward_backward(small, "cross_entropy").result(timeout=120)
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=120)
    assert training.forward(small, "cross_entropy").result(timeout=120).metrics["loss:sum"] < trained
    client.close("success").result(timeout=30)
