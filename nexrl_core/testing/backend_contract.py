"""Contracts for the two halves of training: a `Backend` (the loop's seam) and a `Trainer`
(the algorithm half of a backend built on a service holder).

Subclass `BackendContract` and override ``backend`` with an opened backend; subclass
`TrainerContract` and override ``trainer`` and ``holder`` (a holder at any weights).
The checks are what the loop relies on: sampling with aligned logprobs, a training step
that returns float metrics, weights that reach sampling only on sync, a checkpoint (a
path, or a future of one when it is saved in the background; the next step starts
before it is awaited) that brings sampling back to the weights it saved, and an export
that plain transformers loads and that scores a sample as sampling did. Training data
are real samples of the backend's own model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from nexrl_core.run.checkpoints import as_future
from nexrl_core.testing.hf_model import load_exported, sequence_logprobs
from nexrl_core.testing.rollouts import probe_sample, sampled_group
from nexrl_core.training.backend import Backend
from nexrl_core.training.holders import ServiceHolder
from nexrl_core.training.trainer import Trainer


def _float_metrics(metrics: dict[str, float]) -> None:
    assert metrics, "a training step must report metrics"
    assert all(isinstance(value, float) for value in metrics.values()), metrics


class BackendContract:
    """Checks any backend; override the ``backend`` fixture."""

    @pytest.fixture
    def backend(self) -> Backend:
        raise NotImplementedError("override the 'backend' fixture to return an opened backend")

    def test_run_info_is_strings(self, backend: Backend) -> None:
        info = backend.run_info()
        assert all(isinstance(key, str) and isinstance(value, str) for key, value in info.items()), info

    def test_chat_model_samples_tokens_with_logprobs(self, backend: Backend) -> None:
        sample = probe_sample(backend.chat_model())
        assert sample.prompt_tokens and 0 < len(sample.response_tokens) <= 6
        assert len(sample.response_logprobs) == len(sample.response_tokens)
        assert all(math.isfinite(value) and value <= 0 for value in sample.response_logprobs)

    def test_training_reaches_sampling_on_sync(self, backend: Backend) -> None:
        before = probe_sample(backend.chat_model())
        _float_metrics(backend.train(sampled_group(backend.chat_model()), step=1))
        published = backend.sync_weights(step=1)
        assert isinstance(published, str) and published
        after = probe_sample(backend.chat_model())
        assert (after.response_tokens, after.response_logprobs) != (before.response_tokens, before.response_logprobs), (
            "sampling must see the weights of the last sync"
        )

    def test_checkpoint_brings_sampling_back(self, backend: Backend) -> None:
        saving = as_future(backend.save_checkpoint("contract"))
        saved = probe_sample(backend.chat_model())
        # the next step starts at once, as in the loop, even while a background save runs
        backend.train(sampled_group(backend.chat_model()), step=2)
        backend.sync_weights(step=2)
        assert probe_sample(backend.chat_model()).response_logprobs != saved.response_logprobs
        backend.load_checkpoint(saving.result())
        restored = probe_sample(backend.chat_model())
        assert restored.response_tokens == saved.response_tokens
        assert restored.response_logprobs == pytest.approx(saved.response_logprobs, abs=1e-4)

    def test_export_model_writes_what_sampling_uses(self, backend: Backend, tmp_path: Path) -> None:
        sample = probe_sample(backend.chat_model())
        directory = backend.export_model(tmp_path / "model")
        model, tokenizer = load_exported(directory)
        assert tokenizer.chat_template, "the export must carry the chat template"
        prompt, response = list(sample.prompt_tokens), list(sample.response_tokens)
        exported = sequence_logprobs(model, prompt + response)[len(prompt) - 1 :]
        assert exported == pytest.approx(sample.response_logprobs, abs=1e-4), "the exported model must be the one sampling uses"


class TrainerContract:
    """Checks any registered trainer on a real holder; override ``trainer`` and ``holder``."""

    @pytest.fixture
    def new_trainer(self) -> Callable[[], Trainer]:
        raise NotImplementedError(
            "override the 'new_trainer' fixture to return a function that builds the trainer under test, configured "
            "so that a step moves its state (e.g. an adaptive KL coefficient)"
        )

    @pytest.fixture
    def trainer(self, new_trainer: Callable[[], Trainer]) -> Trainer:
        return new_trainer()

    @pytest.fixture
    def holder(self) -> ServiceHolder:
        raise NotImplementedError("override the 'holder' fixture to return a connected service holder")

    def test_holder_honours_the_train_step(self, trainer: Trainer, holder: ServiceHolder) -> None:
        assert holder.refused_options(trainer.train_step) == {}

    def test_train_then_sync_publishes_new_weights(self, trainer: Trainer, holder: ServiceHolder) -> None:
        before = probe_sample(holder)
        _float_metrics(trainer.train(holder, sampled_group(holder), step=1))
        published = trainer.sync_weights(holder, step=1)
        assert isinstance(published, str) and published
        assert probe_sample(holder).response_logprobs != before.response_logprobs

    def test_a_new_trainer_resumes_from_the_state_through_json(self, new_trainer: Callable[[], Trainer], holder: ServiceHolder) -> None:
        """What ``--resume`` does: a trained trainer's state, through JSON, into a new one."""
        trainer = new_trainer()
        trainer.train(holder, sampled_group(holder), step=1)
        state = trainer.state()
        fresh = new_trainer()
        assert fresh.state() != state, "a step did not move the trainer's state: configure new_trainer so that it does"
        fresh.load_state(json.loads(json.dumps(state)))
        assert fresh.state() == state
