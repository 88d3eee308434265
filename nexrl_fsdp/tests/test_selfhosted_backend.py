"""The ``self-hosted`` backend: refusals before anything starts, the backend contract on a real
2-rank torchrun group, GRPO's `_prepare_batch` through it, and (slow) the quickstart end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from nexrl_core.backend import BackendSetup
from nexrl_core.batch import Batch
from nexrl_core.config import ConfigError, TrainConfig, load_config
from nexrl_core.config.components import resolve_options
from nexrl_core.registry import find_spec
from nexrl_core.run_state import load_run_state
from nexrl_core.testing import BackendContract
from nexrl_core.testing.rollouts import sampled_group
from nexrl_fsdp.selfhosted.backend import SelfHostedBackend
from nexrl_grpo.config import SelfHostedGrpoConfig
from nexrl_grpo.trainers import SelfHostedGrpoTrainer

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "quickstart_fsdp.yaml"
MARKER = "NEXRL_SELF_HOSTED_TEST_RUN"


def recipe(tmp_path: Path, *overrides: str) -> TrainConfig:
    return load_config(RECIPE, [f"output.dir={tmp_path / 'run'}", *overrides])


def open_backend(config: TrainConfig, work_dir: Path) -> SelfHostedBackend:
    options = resolve_options("backends", config.backend, "backend")
    return find_spec("backends", "self-hosted").open(BackendSetup(recipe=config, options=options, work_dir=work_dir))


def processes_with(marker: str) -> list[int]:
    """Pids of this user's processes whose environment holds ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.parametrize(
    ("override", "problem"),
    [
        ("algorithm.loss.options.agg_mode=seq-mean-token-mean", "algorithm.loss.options.agg_mode: 'seq-mean-token-mean'"),
        ("model.lora.rank=4", "model.lora.rank: the self-hosted workers train every weight"),
        ("backend.options.trainer=remote_api_grpo", "backend.options.trainer: trainer 'remote_api_grpo' does not fit"),
        ("model.name=/no/such/model", "model.name: unknown model"),
        ("backend.options.sampler.device=no-such-device", "backend.options.sampler.device:"),
    ],
)
def test_options_the_workers_cannot_honour_are_refused_before_anything_starts(
    tmp_path: Path, override: str, problem: str
) -> None:
    with pytest.raises(ConfigError) as error:
        open_backend(recipe(tmp_path, override), tmp_path / "backend")
    assert any(line.startswith(problem) for line in error.value.problems), error.value.problems
    assert not (tmp_path / "backend" / "workers.log").exists(), "no worker may start for a refused recipe"


@pytest.fixture(scope="module")
def contract_backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SelfHostedBackend]:
    directory = tmp_path_factory.mktemp("self-hosted")
    backend = open_backend(recipe(directory, "backend.options.heartbeat_s=0.5", "backend.options.dead_after_s=10"), directory / "backend")
    try:
        yield backend
    finally:
        backend.close()
    assert backend.group is not None and backend.group.process is None
    assert not backend.chat.compute.running


@pytest.mark.slow
class TestSelfHostedBackendContract(BackendContract):
    @pytest.fixture
    def backend(self, contract_backend: SelfHostedBackend) -> SelfHostedBackend:
        return contract_backend


@pytest.mark.slow
def test_grpo_prepares_kl_in_reward_and_advantages_through_the_workers(contract_backend: SelfHostedBackend, tmp_path: Path) -> None:
    config = recipe(tmp_path, "algorithm.kl.coef=0.5", "algorithm.kl.controller=adaptive", "algorithm.kl.target=0.01")
    trainer = SelfHostedGrpoTrainer(SelfHostedGrpoConfig.from_recipe(config))
    trainer.bind(contract_backend.transport, world_size=2, pad_token_id=contract_backend.trainer.pad_token_id)
    trajectories = sampled_group(contract_backend.chat_model())
    batch = Batch.from_trajectories(trajectories, pad_token_id=trainer.pad_token_id).pad_to_world_size(2)
    prepared, metrics = trainer._prepare_batch(batch)
    tensors = prepared.tensors
    assert set(tensors) >= {"advantages", "ref_logprobs", "token_level_scores", "token_level_rewards", "old_logprobs"}
    # the policy trained by the contract moved away from the reference: KL is measured, charged and steers the coefficient
    assert metrics["kl/mean"] != 0.0 and metrics["kl/coef"] == 0.5 and trainer.kl_in_reward.controller.value != 0.5
    assert not tensors["token_level_rewards"].equal(tensors["token_level_scores"])
    assert tensors["advantages"][~tensors["valid_rows"]].abs().sum() == 0
    assert (tensors["advantages"] * (1 - tensors["loss_mask"])).abs().sum() == 0
    assert metrics["actor/old_logprob_abs_diff"] < 1e-4, "the sampler got the workers' weights"
    assert prepared.tensors["attention_mask"].any(dim=0).all(), "redundant padding columns are removed"
    trainer.close()


@pytest.mark.slow
def test_quickstart_fsdp_learns_and_leaves_no_process(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    out = tmp_path / "run"
    command = [
        str(Path(sys.executable).parent / "nexrl"), "train", str(RECIPE), f"output.dir={out}",
        "schedule.steps=10", "schedule.validate_every=10", "schedule.checkpoint_every=5", "task.val_size=100",
    ]
    result = subprocess.run(command, env={**os.environ, MARKER: marker}, capture_output=True, text=True, timeout=480)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    validation = [row["val/reward/mean"] for row in rows if row.get("val/reward/mean") is not None]
    assert validation[-1] >= validation[0] + 0.1, validation
    last = out / "backend" / "checkpoints" / "step_000010"
    assert (last / "trainer.json").is_file() and (last / "workers" / "hf" / "config.json").is_file()
    state = load_run_state(out)
    assert state is not None and state.step == 10 and state.checkpoint_path == str(last), "the last background save is recorded"
    assert processes_with(marker) == [], "a worker, torchrun or watchdog outlived the run"
