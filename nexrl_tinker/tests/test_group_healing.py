"""A model's worker group heals itself: ``kill -9`` of one of its ranks mid-run costs the
client a slower call, never a step.

The unmodified tinker SDK trains two full fine-tuning models on ``--workers 2`` groups of
one service: one undisturbed, and one whose rank 1 is killed between an acknowledged
forward_backward and the optimizer step that follows it. The group is restarted from the
model's last restart point (saved after every second optimizer step), the acknowledged
forward_backward is replayed, the optimizer step in flight completes, and every later
step's loss equals the undisturbed model's: the curve goes on, it does not restart from
the base model or drop a gradient. The store records the restart.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import tinker
from tinker import types

from nexrl_tinker.testing import BASE_MODEL, sft_data, start_service

pytestmark = pytest.mark.slow

STEPS = 4
KILLED_AT = 2
"""The step whose optimizer step runs while a rank is dead."""
ADAM = types.AdamParams(learning_rate=5e-4)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Groups of two ranks that beat every 0.5 s, count as lost after 3 s of silence and
    save their state every second optimizer step."""
    svc = start_service(tmp_path_factory.mktemp("healing"), workers=2, worker_heartbeat_s=0.5, worker_dead_after_s=3.0, worker_save_every=2)
    try:
        yield svc
    finally:
        svc.stop()


def train(service: Any, kill_rank_at: int | None) -> dict[str, Any]:
    """STEPS steps of SFT; with ``kill_rank_at``, rank 1 of the model's group is killed
    once that step's forward_backward is answered. Each step's loss, and how long the
    step whose optimizer step met the dead rank took from the kill."""
    client = tinker.ServiceClient(base_url=service.base_url)
    training = client.create_lora_training_client(base_model=BASE_MODEL, rank=0).result(timeout=300)
    data = sft_data(training.get_tokenizer())
    losses, killed_pid, recovery_s = [], None, None
    for step in range(STEPS):
        losses.append(training.forward_backward(data, "cross_entropy").result(timeout=300).metrics["loss:sum"])
        if step == kill_rank_at:
            engine = service.state.engines.training(training.model_id)
            killed_pid = engine.rank_pids()[1]
            killed_at = time.monotonic()
            os.kill(killed_pid, signal.SIGKILL)
        training.optim_step(ADAM).result(timeout=300)
        if step == kill_rank_at:
            recovery_s = time.monotonic() - killed_at
    losses.append(training.forward(data, "cross_entropy").result(timeout=300).metrics["loss:sum"])
    return {"model_id": training.model_id, "losses": losses, "killed_pid": killed_pid, "recovery_s": recovery_s}


@pytest.fixture(scope="module")
def runs(service: Any) -> dict[str, dict[str, Any]]:
    return {"undisturbed": train(service, None), "killed": train(service, KILLED_AT)}


def test_a_killed_rank_costs_no_step(runs: dict[str, dict[str, Any]]) -> None:
    undisturbed, killed = runs["undisturbed"]["losses"], runs["killed"]["losses"]
    assert undisturbed[-1] < undisturbed[0] * 0.9, f"the model did not learn: {undisturbed}"
    assert killed == pytest.approx(undisturbed, rel=1e-5), "the healed model's curve must go on as if nothing happened"
    print(f"rank killed -> its step's optimizer step answered: {runs['killed']['recovery_s']:.1f} s")


def test_the_restart_is_recorded_with_what_it_came_back_from(service: Any, runs: dict[str, dict[str, Any]]) -> None:
    killed = runs["killed"]
    (restart,) = service.state.store.restarts_of(killed["model_id"])
    assert restart.restored_from is not None and "autosave" in restart.restored_from, "the last optimizer step's restart point"
    assert restart.replayed == 1, "the acknowledged forward_backward since that step"
    assert "lost" in restart.reason or "dead" in restart.reason
    model = service.state.store.get_model(killed["model_id"])
    assert model.state_dir is not None and "autosave" in model.state_dir and model.state_has_optimizer
    assert not service.state.store.restarts_of(runs["undisturbed"]["model_id"])
    with pytest.raises(ProcessLookupError):
        os.kill(killed["killed_pid"], 0)
