"""Contract every service holder must meet, against a real backend.

Subclass `ServiceHolderContract` and override the ``holder`` fixture to return a holder
connected to a running backend (the local Tinker service, say). The checks are what the
training loop relies on: chat templates render to text or token ids (never a dict),
samples carry aligned tokens and logprobs (tool calls: `ToolCallContract`),
training returns float metrics and moves the model while reference logprobs stay at the
base weights, the default step is honoured, a pickled holder reconnects, and the
exported model is a plain HF directory that scores a sample as sampling did.
"""

from __future__ import annotations

import math
import pickle
from pathlib import Path

import pytest

from nexrl_core.chat.model import SamplingOptions
from nexrl_core.config.adamw import AdamWSettings
from nexrl_core.testing.hf_model import load_exported, sequence_logprobs
from nexrl_core.training.holders import ServiceHolder, TrainStepConfig
from nexrl_core.types import RemoteDatum, SampleResult

MESSAGES = [{"role": "user", "content": "12+7="}]


class ServiceHolderContract:
    """Checks any service holder; override the ``holder`` fixture."""

    @pytest.fixture
    def holder(self) -> ServiceHolder:
        raise NotImplementedError("override the 'holder' fixture to return a connected service holder")

    def test_chat_template_renders_text_and_token_ids(self, holder: ServiceHolder) -> None:
        text = holder.apply_chat_template(MESSAGES, tokenize=False)
        tokens = holder.apply_chat_template(MESSAGES, tokenize=True)
        assert isinstance(text, str) and "12+7=" in text
        assert isinstance(tokens, list) and tokens and all(isinstance(token, int) for token in tokens)
        continued = holder.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=True)
        assert isinstance(continued, list) and len(continued) < len(tokens)

    def test_sample_from_messages_returns_aligned_tokens_and_logprobs(self, holder: ServiceHolder) -> None:
        result = holder.sample_from_messages(MESSAGES, SamplingOptions(max_tokens=6, seed=1))
        assert isinstance(result, SampleResult)
        assert result.prompt_tokens == holder.apply_chat_template(MESSAGES, tokenize=True)
        assert 0 < len(result.response_tokens) <= 6
        assert len(result.response_logprobs) == len(result.response_tokens)
        assert all(math.isfinite(value) and value <= 0 for value in result.response_logprobs)
        assert result.finish_reason in ("stop", "length")

    def test_length_limit_is_reported(self, holder: ServiceHolder) -> None:
        result = holder.sample_from_messages(MESSAGES, SamplingOptions(max_tokens=1, stop=[], seed=2))
        assert len(result.response_tokens) == 1
        assert result.finish_reason == "length"

    def test_same_seed_same_sample(self, holder: ServiceHolder) -> None:
        options = SamplingOptions(max_tokens=6, seed=7)
        first = holder.sample_from_messages(MESSAGES, options)
        second = holder.sample_from_messages(MESSAGES, options)
        assert first.response_tokens == second.response_tokens

    def test_sample_from_prompt(self, holder: ServiceHolder) -> None:
        prompt = holder.apply_chat_template(MESSAGES, tokenize=True)
        assert isinstance(prompt, list)
        result = holder.sample_from_prompt(prompt, SamplingOptions(max_tokens=4, seed=3))
        assert result.prompt_tokens == prompt
        assert len(result.response_logprobs) == len(result.response_tokens) > 0

    def test_train_returns_float_metrics_and_moves_sampling_weights(self, holder: ServiceHolder) -> None:
        prompt = holder.apply_chat_template(MESSAGES, tokenize=True)
        assert isinstance(prompt, list)
        sample = holder.sample_from_prompt(prompt, SamplingOptions(max_tokens=4, seed=4))
        tokens = list(prompt) + list(sample.response_tokens)
        datum = RemoteDatum(
            input_tokens=tokens[:-1],
            target_tokens=tokens[1:],
            sampling_logprobs=[0.0] * (len(prompt) - 1) + list(sample.response_logprobs),
            advantages=[0.0] * (len(prompt) - 1) + [1.0] * len(sample.response_tokens),
            loss_mask=[0.0] * (len(prompt) - 1) + [1.0] * len(sample.response_tokens),
        )
        step = TrainStepConfig(optimizer=AdamWSettings(learning_rate=1e-2))
        assert holder.refused_options(step) == {}, "the default step must be honoured"
        reference = holder.reference_logprobs([tokens])
        assert len(reference) == 1 and len(reference[0]) == len(tokens) and reference[0][0] == 0.0
        before = holder.update_sampling_weights()
        metrics = holder.train([datum], step)
        assert metrics and all(isinstance(value, float) for value in metrics.values())
        after = holder.update_sampling_weights()
        assert isinstance(after, str) and after != before
        repeat = holder.sample_from_prompt(prompt, SamplingOptions(max_tokens=4, seed=4))
        assert repeat.response_logprobs != sample.response_logprobs, "sampling must see the trained weights"
        assert holder.reference_logprobs([tokens])[0] == pytest.approx(reference[0], abs=1e-5), (
            "reference logprobs are the base weights', whatever training did"
        )

    def test_pickled_holder_reconnects(self, holder: ServiceHolder) -> None:
        clone = pickle.loads(pickle.dumps(holder))
        try:
            assert clone.apply_chat_template(MESSAGES, tokenize=True) == holder.apply_chat_template(MESSAGES, tokenize=True)
            assert clone.sample_from_messages(MESSAGES, SamplingOptions(max_tokens=2, seed=5)).response_tokens
        finally:
            clone.close()

    def test_export_model_writes_the_sampling_weights(self, holder: ServiceHolder, tmp_path: Path) -> None:
        holder.update_sampling_weights()
        sample = holder.sample_from_messages(MESSAGES, SamplingOptions(max_tokens=6, seed=8))
        model, tokenizer = load_exported(holder.export_model(tmp_path / "model"))
        assert tokenizer.chat_template, "the export must carry the chat template"
        prompt, response = list(sample.prompt_tokens), list(sample.response_tokens)
        exported = sequence_logprobs(model, prompt + response)[len(prompt) - 1 :]
        assert exported == pytest.approx(sample.response_logprobs, abs=1e-4), "the export must be the sampling weights"
