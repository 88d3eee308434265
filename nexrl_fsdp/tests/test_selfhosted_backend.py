"""The ``self-hosted`` backend: refusals before anything starts, the backend contract on a real
2-rank torchrun group, GRPO's `_prepare_batch` through it, and (slow) the quickstart end to end."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from nexrl_core.config import ConfigError, TrainConfig, load_config
from nexrl_core.config.components import resolve_options
from nexrl_core.plugins.registry import find_spec
from nexrl_core.run.state import load_run_state
from nexrl_core.testing import BackendContract
from nexrl_core.testing.hf_model import load_exported
from nexrl_core.testing.rollouts import sampled_group
from nexrl_core.training.backend import BackendSetup, BackendStartError
from nexrl_core.training.batch import Batch
from nexrl_engine.loading import load_model, resolve_model_dir
from nexrl_fsdp.direct_zmq.group_key import ENV_WORKER_KEY, new_group_key
from nexrl_fsdp.selfhosted.backend import SelfHostedBackend, sampler_threads
from nexrl_fsdp.selfhosted.config import SelfHostedBackendConfig
from nexrl_grpo.config import SelfHostedGrpoConfig
from nexrl_grpo.trainers import SelfHostedGrpoTrainer
from nexrl_testing.processes import ListenerWatch, process_tree, processes_with, tcp_listeners

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "quickstart_fsdp.yaml"
MARKER = "NEXRL_SELF_HOSTED_TEST_RUN"


def recipe(tmp_path: Path, *overrides: str) -> TrainConfig:
    return load_config(RECIPE, [f"output.dir={tmp_path / 'run'}", *overrides])


def open_backend(config: TrainConfig, work_dir: Path) -> SelfHostedBackend:
    options = resolve_options("backends", config.backend, "backend")
    return find_spec("backends", "self-hosted").open(BackendSetup(recipe=config, options=options, work_dir=work_dir))


@pytest.mark.parametrize(
    ("override", "problem"),
    [
        ("backend.options.trainer=remote_api_grpo", "backend.options.trainer: trainer 'remote_api_grpo' does not fit"),
        ("model.name=/no/such/model", "model.name: unknown model"),
        ("backend.options.sampler.device=no-such-device", "backend.options.sampler.device:"),
    ],
)
def test_options_the_workers_cannot_honour_are_refused_before_anything_starts(tmp_path: Path, override: str, problem: str) -> None:
    with pytest.raises(ConfigError) as error:
        open_backend(recipe(tmp_path, override), tmp_path / "backend")
    assert any(line.startswith(problem) for line in error.value.problems), error.value.problems
    assert not (tmp_path / "backend" / "workers.log").exists(), "no worker may start for a refused recipe"


def test_a_workers_url_without_the_key_is_refused_before_anything_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A group started elsewhere answers only its key: a run without ``NEXRL_WORKER_KEY``
    is refused at once, naming it, with no sampler started and nothing sent to the URL."""
    monkeypatch.delenv(ENV_WORKER_KEY, raising=False)
    with pytest.raises(BackendStartError, match=f"set {ENV_WORKER_KEY}"):
        open_backend(recipe(tmp_path, "backend.options.workers_url=http://127.0.0.1:9"), tmp_path / "backend")
    assert not (tmp_path / "backend" / "sampler.log").exists(), "no sampler may start without the key"


CONTRACT_OPTIONS = (
    "backend.options.heartbeat_s=0.5",
    "backend.options.dead_after_s=10",
    "backend.options.identifier=learner",
    "backend.options.connect_timeout_s=120",
    "backend.options.op_timeout_s=300",
    "backend.options.update={ppo_epochs: 2, mini_batches: 2, micro_batch_rows: 4, max_tokens_per_microbatch: 64}",
    "backend.options.recompute_old_logprobs=false",
    "backend.options.sampler={sample_linger_s: 0.002, sample_linger_max_s: 0.02, max_batch_rows: 16}",
)
"""Non-default values for the backend's options, so `test_each_backend_option_reaches_its_part`
can find each where it acts (the contract passes with them too)."""


@pytest.fixture(scope="module")
def contract_backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SelfHostedBackend]:
    directory = tmp_path_factory.mktemp("self-hosted")
    backend = open_backend(recipe(directory, *CONTRACT_OPTIONS), directory / "backend")
    try:
        yield backend
    finally:
        backend.close()
    assert backend.group is not None and backend.group.placed is None
    assert not backend.sampler.alive(), "closing the backend ends the sampler process"


@pytest.mark.slow
class TestSelfHostedBackendContract(BackendContract):
    @pytest.fixture
    def backend(self, contract_backend: SelfHostedBackend) -> SelfHostedBackend:
        return contract_backend


@pytest.mark.slow
def test_each_backend_option_reaches_its_part(contract_backend: SelfHostedBackend) -> None:
    """What the options set is what the group, the transport, the trainer and the sampler run with."""
    backend = contract_backend
    info = backend.transport.info()
    assert (backend.transport.options.identifier, info["world_size"], backend.run_info()["world_size"]) == ("learner", 2, "2")
    assert (backend.transport.options.connect_timeout_s, backend.transport.options.op_timeout_s) == (120, 300)
    assert backend.group is not None and backend.group.server.dead_after_s == 10
    update = {"ppo_epochs": 2, "mini_batches": 2, "micro_batch_rows": 4, "max_tokens_per_microbatch": 64}
    assert update.items() <= backend.trainer.update_options().items()
    assert backend.trainer.config.recompute_old_logprobs is False
    metrics = backend.train(sampled_group(backend.chat_model()), 1)
    backend.sync_weights(1)  # later tests share the backend and expect the sampler to hold the workers' weights
    assert metrics["train/actor/optimizer_steps"] == 4.0, "two epochs of two mini-batches"
    assert "actor/old_logprob_abs_diff" not in metrics, "the sampler's logprobs were trained on as they came"
    sampler = backend.sampler.request({"kind": "info"}).header
    assert (sampler["sample_linger_s"], sampler["sample_linger_max_s"], sampler["max_batch_rows"]) == (0.002, 0.02, 16)
    assert sampler["threads"] == int(sampler_threads(backend_options(backend))), "the sampler runs on the cores left to it"


def backend_options(backend: SelfHostedBackend) -> SelfHostedBackendConfig:
    return SelfHostedBackendConfig(world_size=2, workers_url=None if backend.group is not None else "http://elsewhere")


def test_the_sampler_gets_the_cores_the_local_ranks_and_the_driver_leave(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)))
    assert sampler_threads(SelfHostedBackendConfig(world_size=4)) == "11"
    assert sampler_threads(SelfHostedBackendConfig(world_size=4, workers_url="http://elsewhere:8000")) == "15", (
        "remote ranks use no core here"
    )
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    assert sampler_threads(SelfHostedBackendConfig(world_size=2)) == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert sampler_threads(SelfHostedBackendConfig(world_size=2)) == "3", "the user's setting wins"


@pytest.mark.slow
def test_the_sampler_is_a_process_of_its_own(contract_backend: SelfHostedBackend) -> None:
    """Rollouts sample from another process (its own GIL), which lives while the backend is
    open; the fixture checks it is gone once the backend is closed."""
    sampler = contract_backend.sampler
    assert sampler.pid != os.getpid() and sampler.alive()
    assert sampler.request({"kind": "info"}).header["pid"] == sampler.pid
    assert sampler.pid not in contract_backend.group.rank_pids().values()


@pytest.mark.slow
def test_a_self_hosted_run_listens_on_the_loopback_only(contract_backend: SelfHostedBackend) -> None:
    """The driver (the workers' API server), the worker group and the sampler process
    listen on 127.0.0.1 or ::1 only."""
    assert contract_backend.group is not None and contract_backend.group.placed is not None
    pids = [os.getpid(), contract_backend.sampler.pid, *process_tree(contract_backend.group.placed.process.pid)]
    listeners = tcp_listeners(pids)
    assert {contract_backend.sampler.pid, *contract_backend.group.rank_pids().values()} <= {pid for pid, _, _ in listeners}
    assert [entry for entry in listeners if entry[1] not in ("127.0.0.1", "::1")] == []


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.slow
def test_a_group_started_by_hand_is_driven_through_workers_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The several-machines path of docs/self-hosted.md on one machine: ``nexrl serve workers``
    and ``torchrun -m nexrl_fsdp.worker`` started by hand, each with the run's key in
    ``NEXRL_WORKER_KEY`` as the driver has it, the run given ``workers_url`` (and bf16,
    which the workers load and train in)."""
    url = f"http://127.0.0.1:{_free_port()}"
    log = open(tmp_path / "group.log", "wb")  # noqa: SIM115 - closed below
    monkeypatch.setenv(ENV_WORKER_KEY, new_group_key())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nexrl = str(Path(sys.executable).parent / "nexrl")
    server = subprocess.Popen([nexrl, "serve", "workers", "--port", url.rsplit(":", 1)[1]], stdout=log, stderr=subprocess.STDOUT, env=env)
    workers = None
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, (tmp_path / "group.log").read_text()
                time.sleep(0.2)
        workers = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                "-m",
                "nexrl_fsdp.worker",
                "--api-server-url",
                url,
                "--identifier",
                "remote",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        options = (f"backend.options.workers_url={url}", "backend.options.identifier=remote", "model.dtype=bf16")
        backend = open_backend(recipe(tmp_path, *options), tmp_path / "backend")
        try:
            assert backend.group is None and backend.run_info() == {"dtype": "bfloat16", "device": "cpu", "world_size": "2"}
            assert backend.train(sampled_group(backend.chat_model()), 1)["train/actor/grad_norm"] > 0
        finally:
            backend.close()
        assert workers.wait(timeout=120) == 0, "closing the backend destroys the group, and its ranks end"
    finally:
        for process in (workers, server):
            if process is not None and process.poll() is None:
                process.terminate()
                process.wait(timeout=30)
        log.close()


@pytest.mark.slow
def test_grpo_prepares_kl_in_reward_and_advantages_through_the_workers(contract_backend: SelfHostedBackend, tmp_path: Path) -> None:
    config = recipe(
        tmp_path, "algorithm.kl.coef=0.5", "algorithm.kl.controller=adaptive", "algorithm.kl.target=0.01", "algorithm.kl.horizon=50"
    )
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


def train_on_the_loopback(command: list[str], marker: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``nexrl train`` under a `ListenerWatch`, which ends it the moment a process of it
    listens beyond the loopback: no process of the run (the driver and its workers' API
    server, the sampler process, torchrun, the ranks' store, gloo and data sockets) ever
    listens beyond 127.0.0.1 and ::1, from the first step to the last save."""
    with ListenerWatch(marker) as watch:
        result = watch.run(command, env={**os.environ, MARKER: marker}, timeout=timeout)
    assert watch.beyond_loopback() == [], f"listening beyond the loopback: {watch.beyond_loopback()} (of {sorted(watch.seen)})"
    assert len({pid for pid, _, _ in watch.seen}) >= 4, f"the driver, the sampler and both ranks listen: {sorted(watch.seen)}"
    return result


@pytest.mark.slow
def test_quickstart_fsdp_runs_to_its_last_step_learns_and_leaves_no_process(tmp_path: Path) -> None:
    """The README's self-hosted command as it is (40 steps on 2 ranks, four checkpoints and
    eight validations), but a smaller held-out set: it once stopped at step 20, where the
    ranks' shards first differed in whether their rows shared a prompt."""
    marker = uuid.uuid4().hex
    out = tmp_path / "run"
    command = [str(Path(sys.executable).parent / "nexrl"), "train", str(RECIPE), f"output.dir={out}", "task.val_size=100"]
    result = train_on_the_loopback(command, marker, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(row["step"] for row in rows) == 40
    validation = [row["val/reward/mean"] for row in rows if row.get("val/reward/mean") is not None]
    assert len(validation) >= 9 and validation[-1] >= validation[0] + 0.3, validation
    assert (rows[0]["backend/dtype"], rows[0]["backend/world_size"]) == ("float32", "2"), "the workers report what they run"
    last = out / "backend" / "checkpoints" / "step_000040"
    assert (last / "trainer.json").is_file() and (last / "workers" / "hf" / "config.json").is_file()
    state = load_run_state(out)
    assert state is not None and state.step == 40 and state.checkpoint_path == str(last), "the last background save is recorded"
    assert processes_with(marker) == [], "a worker, torchrun or watchdog outlived the run"


@pytest.mark.slow
def test_a_worker_group_that_cannot_start_stops_the_run_in_one_line(tmp_path: Path) -> None:
    """A rank that fails while it starts (here: a device setting it refuses) ends the run
    before step 1 with one line naming the rank's error and the ranks' log, in seconds,
    and nothing is left running."""
    marker = uuid.uuid4().hex
    out = tmp_path / "run"
    command = [str(Path(sys.executable).parent / "nexrl"), "train", str(RECIPE), f"output.dir={out}"]
    started = time.monotonic()
    result = subprocess.run(
        command, env={**os.environ, MARKER: marker, "NEXRL_WORKER_DEVICE": "tpu"}, capture_output=True, text=True, timeout=300
    )
    assert time.monotonic() - started < 120, "the rank's failure, not the connect timeout (180 s)"
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert "worker group could not start" in line and "failed: ValueError: NEXRL_WORKER_DEVICE='tpu'" in line, line
    assert str(out / "backend" / "workers.log") in line, line
    assert processes_with(marker) == []


@pytest.mark.slow
def test_quickstart_fsdp_trains_lora_adapters_end_to_end(tmp_path: Path) -> None:
    """The recipe's LoRA settings reach the workers (the adapter's rank, alpha and targets:
    the MLP alone), the sampler samples the merged policy the workers train (the
    recomputed old logprobs agree with the sampler's), and the run leaves merged weights
    plus the adapter, in its checkpoints and as its final model."""
    from peft import PeftModel

    out = tmp_path / "run"
    command = [
        str(Path(sys.executable).parent / "nexrl"),
        "train",
        str(RECIPE),
        f"output.dir={out}",
        "schedule.steps=3",
        "schedule.validate_every=0",
        "schedule.checkpoint_every=3",
        "task.val_size=4",
        "rollout.prompts_per_step=8",
        "rollout.group_size=4",
        "algorithm.learning_rate=1e-3",
        "model.lora.rank=4",
        "model.lora.alpha=8",
        "model.lora.train_attn=false",
        "model.lora.train_unembed=false",
    ]
    result = train_on_the_loopback(command, uuid.uuid4().hex, timeout=480)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    differences = [row["actor/old_logprob_abs_diff"] for row in rows if row["step"] >= 1]
    assert len(differences) == 3 and max(differences) < 1e-4, "the sampler samples the workers' merged policy"
    final = out / "final_model"
    for export in (out / "backend" / "checkpoints" / "step_000003" / "workers" / "hf", final):
        adapter = json.loads((export / "adapter" / "adapter_config.json").read_text())
        assert (adapter["r"], adapter["lora_alpha"], adapter["target_modules"]) == (4, 8.0, ["down_proj", "gate_proj", "up_proj"])
    merged, _ = load_exported(final)
    base = load_model(resolve_model_dir("nexrl-tiny"), torch.float32)
    trained = {name for name, p in merged.named_parameters() if not torch.equal(p, dict(base.named_parameters())[name])}
    assert trained and all(name.rsplit(".", 2)[-2] in ("gate_proj", "up_proj", "down_proj") for name in trained)
    adapted = PeftModel.from_pretrained(base, str(final / "adapter"))
    probe = torch.tensor([[1, 40, 50, 60, 70]])
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=probe).logits, merged(input_ids=probe).logits, atol=1e-5, rtol=0)
