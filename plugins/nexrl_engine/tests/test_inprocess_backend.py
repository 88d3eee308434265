"""The ``inprocess`` backend from a recipe: registration, options, errors, checkpoints,
and (slow) the quickstart end to end."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from nexrl_core.config import ConfigError
from nexrl_core.config.components import resolve_options
from nexrl_core.run.loop import run_training
from nexrl_core.testing import BackendContract
from nexrl_core.training.holder_backend import HolderBackend

from tests.conftest import open_backend, quickstart


@pytest.fixture(scope="module")
def contract_backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HolderBackend]:
    directory = tmp_path_factory.mktemp("contract")
    backend = open_backend(quickstart(directory), directory / "backend")
    try:
        yield backend
    finally:
        backend.close()


class TestInProcessBackendContract(BackendContract):
    @pytest.fixture
    def backend(self, contract_backend: HolderBackend) -> HolderBackend:
        return contract_backend


def test_registering_the_backend_does_not_import_torch() -> None:
    code = "import sys, nexrl_engine.plugin; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_recipe_settings_reach_the_engine(tmp_path: Path) -> None:
    config = quickstart(
        tmp_path,
        "model.dtype=bf16",
        "backend.options.max_tokens_per_microbatch=512",
        "backend.options.share_prefixes=false",
        "backend.options.max_batch_rows=32",
        "backend.options.sample_linger_s=0.003",
        "backend.options.sample_linger_max_s=0.03",
    )
    backend = open_backend(config, tmp_path / "backend")
    try:
        compute = backend.holder.compute  # type: ignore[attr-defined]
        assert (compute._linger_s, compute._linger_max_s, compute._max_batch_rows) == (0.003, 0.03, 32)
        engine = backend.holder.engine  # type: ignore[attr-defined]
        assert (engine.config.dtype, engine.config.max_tokens_per_microbatch, engine.config.share_prefixes) == (
            "bfloat16",
            512,
            False,
        )
        for model in (engine.model, backend.holder.sampler.model):  # type: ignore[attr-defined]
            assert {parameter.dtype for parameter in model.parameters()} == {torch.bfloat16}
        assert backend.trainer.train_step.loss_fn_config == {"agg_mode": "token-sum", "entropy_coeff": 0.0}
    finally:
        backend.close()
    assert not backend.holder.compute.running  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("flags", "adapted", "untouched"),
    [
        (("model.lora.train_mlp=false",), ("self_attn", "lm_head"), ("mlp",)),
        (("model.lora.train_attn=false", "model.lora.train_unembed=false"), ("mlp",), ("self_attn", "lm_head")),
    ],
)
def test_lora_settings_reach_the_engine(
    tmp_path: Path, flags: tuple[str, ...], adapted: tuple[str, ...], untouched: tuple[str, ...]
) -> None:
    config = quickstart(tmp_path, "model.lora.rank=4", "model.lora.alpha=8", *flags)
    backend = open_backend(config, tmp_path / "backend")
    try:
        engine = backend.holder.engine  # type: ignore[attr-defined]
        assert engine.is_lora and (engine.config.lora.rank, engine.config.lora.alpha) == (4, 8.0)
        trained = engine.trainable_parameter_names()
        assert all(any(part in name for name in trained) for part in adapted), trained
        assert not any(part in name for name in trained for part in untouched), trained
    finally:
        backend.close()


@pytest.mark.parametrize(
    ("override", "problem"),
    [
        ("model.name=/no/such/model", "model.name: unknown model '/no/such/model'"),
        ("model.name=null", "model.name: not set"),
        ("backend.options.trainer=no_such_trainer", "backend.options.trainer:"),
        ("backend.options.device=no-such-device", "backend.options.device: 'no-such-device' is not a torch device"),
    ],
)
def test_bad_settings_are_config_errors_naming_the_key(tmp_path: Path, override: str, problem: str) -> None:
    with pytest.raises(ConfigError) as error:
        open_backend(quickstart(tmp_path, override), tmp_path / "backend")
    assert any(line.startswith(problem) for line in error.value.problems), error.value.problems


def test_bad_option_values_fail_when_the_recipe_is_checked(tmp_path: Path) -> None:
    config = quickstart(tmp_path, "backend.options.max_batch_rows=0", "backend.options.sample_linger_s=-1")
    with pytest.raises(ConfigError) as error:
        resolve_options("backends", config.backend, "backend")
    assert {line.split(":")[0] for line in error.value.problems} == {
        "backend.options.max_batch_rows",
        "backend.options.sample_linger_s",
    }


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_refused_before_loading(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="backend.options.device: 'cuda' asks for CUDA"):
        open_backend(quickstart(tmp_path, "backend.options.device=cuda"), tmp_path / "backend")


def test_checkpoints_live_in_the_backend_directory(tmp_path: Path) -> None:
    work_dir = tmp_path / "backend"
    backend = open_backend(quickstart(tmp_path), work_dir)
    try:
        record_path = backend.save_checkpoint("step_000001")
        record = json.loads(Path(record_path).read_text())
        assert Path(record["holder"]) == work_dir / "engine" / "step_000001"
        backend.load_checkpoint(record_path)
    finally:
        backend.close()


def reward_rows(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(("dtype", "ran"), [("fp32", "float32"), ("bf16", "bfloat16")])
def test_metrics_say_which_dtype_trained(tmp_path: Path, dtype: str, ran: str) -> None:
    settings = ("schedule.steps=1", "schedule.validate_every=0", "rollout.prompts_per_step=2", "rollout.group_size=4")
    run_training(quickstart(tmp_path, f"model.dtype={dtype}", *settings), progress_bar=False)
    (row,) = reward_rows(tmp_path / "run")
    assert (row["step"], row["backend/dtype"], row["backend/device"]) == (1, ran, "cpu")
    assert row["train/grad_norm"] > 0


def test_per_token_advantages_reach_the_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """reinforce_plus_plus (gamma 0.5) through the holder trainer onto the real engine:
    the trained tokens of a run carry different advantages, and the run trains."""
    from nexrl_engine.inprocess.holder import EngineHolder

    received: list = []
    train = EngineHolder.train
    monkeypatch.setattr(EngineHolder, "train", lambda self, datums, config: received.extend(datums) or train(self, datums, config))
    settings = ("schedule.steps=1", "schedule.validate_every=0", "rollout.prompts_per_step=4", "rollout.group_size=4")
    estimator = ("algorithm.advantage.name=reinforce_plus_plus", "algorithm.advantage.options.gamma=0.5")
    run_training(quickstart(tmp_path, *settings, *estimator), progress_bar=False)
    (row,) = reward_rows(tmp_path / "run")
    assert row["train/grad_norm"] > 0
    per_run = [{a for a, m in zip(datum.advantages, datum.loss_mask) if m} for datum in received]
    assert any(len(values) > 1 for values in per_run), "advantages vary along a run's tokens"


@pytest.mark.parametrize("overflow", ["truncate_left", "skip"])
def test_prompt_and_response_limits_hold_through_a_whole_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overflow: str) -> None:
    """The addition prompts are 12 to 14 tokens; with ``rollout.max_prompt_tokens=13``
    every prompt the engine samples after has at most 13 (``truncate_left`` cuts the
    14-token ones, ``skip`` drops their runs, counted in training and validation and not
    against an error budget of 0), and no run generates more than
    ``rollout.max_response_tokens=2`` tokens (a two-digit sum needs 3 with its end marker)."""
    from nexrl_engine.inprocess.holder import EngineHolder

    sampled: list[tuple[int, int]] = []
    sample = EngineHolder.sample_from_prompt
    monkeypatch.setattr(
        EngineHolder,
        "sample_from_prompt",
        lambda self, prompt, options: sampled.append((len(prompt), options.max_tokens)) or sample(self, prompt, options),
    )
    settings = ("schedule.steps=1", "schedule.validate_every=1", "task.val_size=32", "rollout.prompts_per_step=16", "rollout.group_size=2")
    limits = (
        "rollout.max_prompt_tokens=13",
        f"rollout.prompt_overflow={overflow}",
        "rollout.max_response_tokens=2",
        "rollout.error_budget=0",
    )
    run_training(quickstart(tmp_path, *settings, *limits), progress_bar=False)
    validation, step = reward_rows(tmp_path / "run")[:2]
    assert {length for length, _ in sampled} <= {12, 13} and {cap for _, cap in sampled} == {2}
    assert step["rollout/response_tokens"] <= 2 * (step["rollout/runs"] - step["rollout/skipped_runs"])
    assert step["rollout/truncated_fraction"] > 0 and step["rollout/agent_errors"] == 0
    if overflow == "skip":
        assert 0 < step["rollout/skipped_runs"] < step["rollout/runs"] and 0 < validation["val/rollout/skipped_runs"] < 32
        skipped = step["rollout/skipped_runs"] + validation["val/rollout/skipped_runs"] + step["val/rollout/skipped_runs"]
        assert len(sampled) == 3 * 32 - skipped
    else:
        assert step["rollout/skipped_runs"] == 0 and len(sampled) == 3 * 32 and step["train/grad_norm"] > 0


@pytest.mark.slow
def test_the_quickstart_learns_and_leaves_nothing_running(tmp_path: Path) -> None:
    before = set(threading.enumerate())
    config = quickstart(tmp_path, "schedule.steps=6", "rollout.prompts_per_step=8", "schedule.validate_every=6")
    run_training(config, progress_bar=False)
    rows = reward_rows(tmp_path / "run")
    validation = [row["val/reward/mean"] for row in rows if "val/reward/mean" in row]
    assert [row["step"] for row in rows if "val/reward/mean" in row] == [0, 6]
    assert validation[1] > validation[0] + 0.2, validation
    assert [thread for thread in threading.enumerate() if thread not in before] == []


@pytest.mark.slow
def test_a_resumed_run_matches_an_uninterrupted_one(tmp_path: Path) -> None:
    settings = ("rollout.prompts_per_step=4", "schedule.validate_every=0", "schedule.checkpoint_every=2")
    run_training(quickstart(tmp_path, "schedule.steps=4", *settings, name="straight"), progress_bar=False)
    run_training(quickstart(tmp_path, "schedule.steps=2", *settings, name="resumed"), progress_bar=False)
    run_training(quickstart(tmp_path, "schedule.steps=4", *settings, name="resumed"), resume=True, progress_bar=False)
    straight, resumed = reward_rows(tmp_path / "straight"), reward_rows(tmp_path / "resumed")
    assert [row["reward/mean"] for row in resumed] == [row["reward/mean"] for row in straight]
    # Sampler logprobs depend on how requests were batched up to float rounding (~1e-5),
    # and a resumed run's first batch forms differently, so the gradients agree to rounding.
    assert resumed[-1]["train/grad_norm"] == pytest.approx(straight[-1]["train/grad_norm"], rel=1e-3)
