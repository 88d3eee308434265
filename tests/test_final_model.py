"""The trained model is an output, end to end, on both local backends: the quickstart's
``remote_api`` on the embedded Tinker service and ``inprocess``.

A short run leaves ``<output.dir>/final_model``, which plain transformers loads (chat
template included) and which scores held-out conversations exactly as the backend's own
final weights do: the tinker SDK's ``compute_logprobs`` on the run's last sampler
weights, or the in-process sampler engine. A LoRA run exports merged weights plus the
adapter, and ``nexrl export`` of the last step writes the same files.
"""

from __future__ import annotations

from collections.abc import Iterator
from importlib.resources import as_file, files
from pathlib import Path
from typing import Any

import attrs
import pytest
from click.testing import CliRunner

from nexrl_core.cli import cli
from nexrl_core.config import TrainConfig, load_config
from nexrl_core.config.components import resolve_options
from nexrl_core.run.loop import RunSummary, open_backend, run_training
from nexrl_core.run.state import load_run_state
from nexrl_core.testing.hf_model import load_exported, sequence_logprobs
from nexrl_core.training.backend import Backend

pytestmark = pytest.mark.slow

STEPS = 3
HELD_OUT = [("12+7=", "19"), ("40+25=", "65"), ("8+8=", "17")]
"""Conversations no run trains on (the addition task draws its items at random)."""


@attrs.frozen
class Run:
    config: TrainConfig
    summary: RunSummary

    @property
    def out_dir(self) -> Path:
        return Path(self.config.output.dir)


def short_quickstart(out_dir: Path, backend: str, lora_rank: int) -> TrainConfig:
    overrides = [
        f"output.dir={out_dir}",
        f"schedule.steps={STEPS}",
        "schedule.checkpoint_every=2",
        "schedule.validate_every=0",
        "task.val_size=4",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        f"model.lora.rank={lora_rank}",
        "algorithm.learning_rate=1e-3",  # so that three steps move the model clearly
    ]
    if backend != "remote_api":
        overrides += [f"backend.name={backend}", "backend.options={}"]
    with as_file(files("nexrl_core").joinpath("recipes", "quickstart.yaml")) as path:
        return load_config(path, overrides)


@pytest.fixture(
    scope="module",
    params=[("remote_api", 0), ("remote_api", 4), ("inprocess", 0), ("inprocess", 4)],
    ids=lambda param: f"{param[0]}-lora{param[1]}",
)
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Run:
    backend, rank = request.param
    config = short_quickstart(tmp_path_factory.mktemp(f"{backend}-lora{rank}") / "run", backend, rank)
    return Run(config, run_training(config, progress_bar=False))


@pytest.fixture
def reopened(run: Run) -> Iterator[Backend]:
    """The run's backend, opened again from its saved recipe (the embedded service
    restarts on the run's data)."""
    config = load_config(run.out_dir / "config.yaml", [])
    backend = open_backend(config, resolve_options("backends", config.backend, "backend"), run.out_dir)
    try:
        yield backend
    finally:
        backend.close()


def held_out_tokens(tokenizer: Any) -> list[list[int]]:
    conversations = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in HELD_OUT]
    return [tokenizer.apply_chat_template(c, tokenize=True, return_dict=False) for c in conversations]


def backends_own_logprobs(run: Run, backend: Any, sequences: list[list[int]]) -> list[list[float]]:
    """``log p(token[i] | tokens[:i])``, i >= 1, under the run's final weights, computed by the backend itself."""
    if run.config.backend.name == "remote_api":
        import tinker

        holder = backend.holder
        rest = tinker.RestClient(base_url=holder.config.base_url, api_key=holder.config.api_key)
        samplers = [c for c in rest.list_user_checkpoints().result().checkpoints if c.checkpoint_type == "sampler"]
        final = max(samplers, key=lambda checkpoint: checkpoint.tinker_path)  # sampler_<n>: n counts the syncs
        service = tinker.ServiceClient(base_url=holder.config.base_url, api_key=holder.config.api_key)
        try:
            sampling = service.create_sampling_client(model_path=final.tinker_path).result()
            futures = [sampling.compute_logprobs(tinker.types.ModelInput.from_ints(tokens)) for tokens in sequences]
            return [list(future.result())[1:] for future in futures]
        finally:
            service.close("success").result()
    checkpoints = load_run_state(run.out_dir).checkpoint_paths()  # type: ignore[union-attr]
    assert max(checkpoints) == STEPS
    backend.load_checkpoint(checkpoints[STEPS])  # the engine holder's sampler now has the final weights
    rows = backend.holder.sampler.compute_logprobs(sequences)
    return [list(row[1:]) for row in rows]


def test_final_model_loads_with_plain_transformers(run: Run) -> None:
    final = run.out_dir / "final_model"
    assert run.summary.final_model == final and run.summary.final_model_error is None
    model, tokenizer = load_exported(final)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert model.config.model_type == "qwen2"
    if run.config.model.lora.rank:
        import json

        adapter = json.loads((final / "adapter" / "adapter_config.json").read_text())
        assert adapter["r"] == 4 and (final / "adapter" / "adapter_model.safetensors").is_file()
        assert not any("lora" in name for name, _ in model.named_parameters()), "the weights must be merged"
    else:
        assert not (final / "adapter").exists()


def test_final_model_scores_like_the_backends_final_weights(run: Run, reopened: Backend) -> None:
    model, tokenizer = load_exported(run.out_dir / "final_model")
    sequences = held_out_tokens(tokenizer)
    expected = backends_own_logprobs(run, reopened, sequences)
    for tokens, own in zip(sequences, expected, strict=True):
        assert sequence_logprobs(model, tokens) == pytest.approx(own, abs=1e-4)


def test_final_model_is_trained_not_the_base(run: Run) -> None:
    from nexrl_engine.loading import resolve_model_dir

    final, tokenizer = load_exported(run.out_dir / "final_model")
    base, _ = load_exported(resolve_model_dir("nexrl-tiny"))
    tokens = held_out_tokens(tokenizer)[0]
    assert sequence_logprobs(final, tokens) != pytest.approx(sequence_logprobs(base, tokens), abs=1e-4)


def test_nexrl_export_of_the_last_step_writes_the_same_files(run: Run) -> None:
    result = CliRunner().invoke(cli, ["export", str(run.out_dir)])
    assert result.exit_code == 0, result.output
    exported = run.out_dir / f"export_step_{STEPS}"
    assert result.output.strip().splitlines()[-1] == str(exported)
    final = run.out_dir / "final_model"
    names = sorted(str(path.relative_to(final)) for path in final.rglob("*") if path.is_file())
    assert names == sorted(str(path.relative_to(exported)) for path in exported.rglob("*") if path.is_file())
    for name in names:
        assert (final / name).read_bytes() == (exported / name).read_bytes(), name
