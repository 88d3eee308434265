"""`nexrl export tinker://...`: a checkpoint the service holds, written as a plain HF
directory through the Tinker API's own download, given the recipe that reaches the service."""

from __future__ import annotations

from importlib.resources import as_file, files
from pathlib import Path

import pytest
from click.testing import CliRunner

from nexrl_core.chat.model import SamplingOptions
from nexrl_core.cli import cli
from nexrl_core.config import ModelConfig
from nexrl_core.config.adamw import AdamWSettings
from nexrl_core.testing.hf_model import load_exported, sequence_logprobs
from nexrl_core.testing.rollouts import CONTRACT_MESSAGES, sampled_group
from nexrl_core.training.holder_trainer import HolderTrainer
from nexrl_core.training.holders import TrainStepConfig
from nexrl_tinker.holder import TinkerServiceHolder
from nexrl_tinker.holder_config import TinkerHolderConfig


@pytest.mark.slow
def test_export_a_tinker_checkpoint_path(base_url: str, tmp_path: Path) -> None:
    holder = TinkerServiceHolder(TinkerHolderConfig(model=ModelConfig(name="nexrl-tiny"), base_url=base_url))
    try:
        trainer = HolderTrainer()
        trainer.train_step = TrainStepConfig(optimizer=AdamWSettings(learning_rate=1e-2))
        trainer.train(holder, sampled_group(holder), step=1)
        holder.update_sampling_weights()
        path = holder.save_checkpoint("exported")
        sample = holder.sample_from_messages(CONTRACT_MESSAGES, SamplingOptions(max_tokens=6, seed=3))
    finally:
        holder.close()
    assert path.startswith("tinker://")

    out = tmp_path / "model"
    with as_file(files("nexrl_core").joinpath("recipes", "quickstart.yaml")) as recipe:
        result = CliRunner().invoke(
            cli, ["export", path, "--recipe", str(recipe), "--set", f"backend.options.base_url={base_url}", "--out", str(out)]
        )
    assert result.exit_code == 0, result.output
    assert result.output.strip().endswith(str(out))
    model, tokenizer = load_exported(out)
    assert tokenizer.chat_template
    prompt, response = list(sample.prompt_tokens), list(sample.response_tokens)
    exported = sequence_logprobs(model, prompt + response)[len(prompt) - 1 :]
    assert exported == pytest.approx(sample.response_logprobs, abs=1e-4)


def test_a_service_path_needs_a_recipe() -> None:
    result = CliRunner().invoke(cli, ["export", "tinker://run/weights/x"])
    assert result.exit_code == 2 and "needs --recipe" in result.output
