"""`SdkServiceHolder`'s own promises, on an SDK written in this test: pickling to config
and weights, retries with backoff that name the service, one request for a group's
concurrent samples, refusals by recipe key for a hosted service, and exports only of the
weights sampling uses. The Tinker and Weaver suites run the same skeleton on the real
SDKs against a real service; here it is alone, so a failure points at it."""

from __future__ import annotations

import pickle
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import attrs
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from nexrl_core.chat.model import SamplingOptions
from nexrl_core.config import ModelConfig
from nexrl_core.http.capabilities import NexrlCapabilities
from nexrl_core.training.holders import TrainStepConfig
from nexrl_core.training.model_export import ModelExportError
from nexrl_core.types import RemoteDatum
from nexrl_remote_api.retries import RetriesExhausted
from nexrl_remote_api.sdk_holder import SampledSequence, SdkServiceHolder
from nexrl_remote_api.sdk_holder_config import SdkHolderConfig

WORDS = ["<pad>", "<eos>", "<|im_start|>", "<|im_end|>", "user", "assistant", "hi", "yes", "no", "\n"]
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
STOP = ["<|im_end|>"]


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A real fast tokenizer over ``WORDS`` with a ChatML template (no download)."""
    vocab = {word: index for index, word in enumerate(WORDS)}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="<eos>", pad_token="<pad>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    return tokenizer


class Transient(ConnectionError):
    """What the test SDK raises for a failure a retry may pass."""


@attrs.frozen(kw_only=True)
class ScriptedConfig(SdkHolderConfig):
    failures: int = 0
    """How many of each call's first attempts fail with `Transient`."""
    reply: tuple[int, ...] = (7, 3)
    """``yes <|im_end|>``: a reply that ends at the stop."""
    logprobs: tuple[float, ...] = (-0.5, -0.25)
    nexrl_service: bool = False
    """Answer as a NexRL service (the capabilities probe's answer) instead of a hosted one."""


class ScriptedHolder(SdkServiceHolder[ScriptedConfig]):
    """The SDK's side, in memory: clients are counters, sample requests are recorded."""

    api: ClassVar[str] = "Scripted"
    hosted_losses: ClassVar[frozenset[str]] = frozenset({"importance_sampling"})

    def __init__(self, config: ScriptedConfig, sampling_path: str | None = None) -> None:
        self.connections = 0
        self.sample_requests: list[tuple[str, list[int], int]] = []
        """(the weights sampled, prompt, samples) of each request sent."""
        self.attempts: dict[str, int] = {}
        self.published: list[str] = []
        super().__init__(config, sampling_path)

    def _service_client(self) -> Any:
        with self._lock:
            if self._service is None:
                self.connections += 1
                self._service = object()
            return self._service

    def _training_client(self) -> Any:
        self._service_client()
        return "training"

    def _sampling_client_of(self, path: str) -> Any:
        self._service_client()
        return path

    def _close_service(self, service: Any) -> None:
        pass

    def _auth_headers(self) -> Mapping[str, str]:
        return {}

    def service_capabilities(self) -> NexrlCapabilities | None:
        return NexrlCapabilities(dtype="fp32") if self.config.nexrl_service else None

    def _service_tokenizer(self) -> Any:
        return word_tokenizer()

    def _is_transient(self, error: BaseException) -> bool:
        return isinstance(error, Transient)

    def _failure(self, what: str, error: BaseException) -> BaseException | None:
        return RuntimeError(f"{self._where()} refused to {what}: {error}") if isinstance(error, ValueError) else None

    def _flaky(self, what: str) -> None:
        self.attempts[what] = self.attempts.get(what, 0) + 1
        if self.attempts[what] <= self.config.failures:
            raise Transient(f"{what}: connection reset")

    def _send_sample(self, prompt: list[int], options: SamplingOptions, num_samples: int) -> list[SampledSequence]:
        self.sample_requests.append((self._sampling_client(), prompt, num_samples))
        reply = SampledSequence(list(self.config.reply), list(self.config.logprobs), "stop")
        return [reply] * num_samples

    def update_sampling_weights(self, weight_path: str | None = None) -> str:
        name = self._next_sampler_name()
        path = weight_path or self._retry("save sampler weights", lambda: self._save(name))
        with self._lock:
            self._sampling = self._sampling_client_of(path)
            self._sampling_path = path
            self._samples_trained_weights = weight_path is None
        return path

    def _save(self, name: str) -> str:
        self._flaky("save sampler weights")
        self.published.append(name)
        return f"scripted://{name}"

    def _datum(self, datum: RemoteDatum, loss_fn: str) -> Any:
        return datum

    def _hosted_loss_config(self, config: TrainStepConfig) -> dict[str, float]:
        return {}

    def _train_step(self, training: Any, data: list[Any], config: TrainStepConfig, loss_fn_config: dict[str, Any]) -> dict[str, float]:
        return {"rows": float(len(data))}

    def _hosted_option_refusal(self, loss_fn: str, option: str, value: Any) -> str | None:
        return None if option == "clip_low" else self._no_such_option(loss_fn)

    def _export_weights(self, training: Any) -> Any:
        return self._sampling_path

    def _download_export(self, export: Any, directory: Path) -> str:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text("{}")
        return str(export)


def holder(**fields: Any) -> ScriptedHolder:
    return ScriptedHolder(ScriptedConfig(model=ModelConfig(name="scripted"), retry_backoff_s=0.001, **fields))


def datum() -> RemoteDatum:
    return RemoteDatum(
        input_tokens=[1, 2], target_tokens=[2, 3], sampling_logprobs=[0.0, -1.0], advantages=[0.0, 1.0], loss_mask=[0.0, 1.0]
    )


def test_a_pickled_holder_is_its_config_and_weights_and_connects_on_first_use() -> None:
    original = holder(max_retries=2)
    path = original.update_sampling_weights()
    copy = pickle.loads(pickle.dumps(original))
    assert isinstance(copy, ScriptedHolder)
    assert (copy.config, copy.connections, copy.published) == (original.config, 0, [])
    copy.sample_from_prompt([6], SamplingOptions(stop=STOP))
    assert copy.connections == 1
    assert copy.sample_requests == [(path, [6], 1)], "the copy samples the weights the original published"
    assert copy.published == [], "and saves no new ones"


def test_transient_errors_are_retried_and_running_out_names_the_service() -> None:
    patient = holder(failures=2, max_retries=2)
    assert patient.update_sampling_weights() == "scripted://sampler_000000"
    assert patient.attempts["save sampler weights"] == 3
    impatient = holder(failures=3, max_retries=2)
    with pytest.raises(RetriesExhausted, match="the Scripted service at the default URL"):
        impatient.update_sampling_weights()
    assert impatient.attempts["save sampler weights"] == 3, "max_retries=2 is three attempts in all"


def test_a_failure_retrying_cannot_fix_is_worded_by_the_sdk_side_at_once() -> None:
    scripted = holder(max_retries=3)
    calls = []

    def refused() -> None:
        calls.append(1)
        raise ValueError("bad shape")

    with pytest.raises(RuntimeError, match="the Scripted service at the default URL refused to train: bad shape"):
        scripted._retry("train", refused)
    assert len(calls) == 1


def test_a_groups_concurrent_samples_travel_as_one_request() -> None:
    scripted = holder(coalesce_window_s=0.5)
    scripted.update_sampling_weights()
    group = 5
    start = threading.Barrier(group)
    results = []

    def sample() -> None:
        start.wait()
        results.append(scripted.sample_from_prompt([6, 9], SamplingOptions(stop=STOP, temperature=0.7)))

    threads = [threading.Thread(target=sample) for _ in range(group)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert scripted.sample_requests == [("scripted://sampler_000000", [6, 9], group)]
    assert [result.response_tokens for result in results] == [[7, 3]] * group
    assert results[0].response_text == "yes", "the reply is read as its text, without the end-of-turn marker"


def test_a_sample_without_a_logprob_per_token_is_refused() -> None:
    scripted = holder(logprobs=(-0.5,))
    scripted.update_sampling_weights()
    with pytest.raises(RuntimeError, match="Scripted returned 2 tokens but 1 logprobs"):
        scripted.sample_from_prompt([6], SamplingOptions(stop=STOP))


@pytest.mark.parametrize(
    ("loss_fn", "options", "refused"),
    [
        ("importance_sampling", {"agg_mode": "token-sum", "clip_low": 0.2}, set()),
        ("importance_sampling", {"agg_mode": "seq-mean-token-mean"}, {"loss_fn_config.agg_mode"}),
        ("importance_sampling", {"entropy_coeff": 0.01}, {"loss_fn_config.entropy_coeff"}),
        ("ppo", {}, {"loss_fn"}),
    ],
)
def test_a_hosted_service_refuses_by_recipe_key_what_it_cannot_compute(loss_fn: str, options: dict[str, Any], refused: set[str]) -> None:
    config = TrainStepConfig(loss_fn=loss_fn, loss_fn_config=options)
    assert set(holder().refused_options(config)) == refused
    assert holder(nexrl_service=True).refused_options(config) == {}, "a NexRL service computes every registered loss"


def test_an_export_is_refused_until_sampling_uses_the_trained_weights(tmp_path: Path) -> None:
    scripted = holder()
    scripted.update_sampling_weights()
    scripted.train([datum()], TrainStepConfig(loss_fn="importance_sampling"))
    with pytest.raises(ModelExportError, match="call update_sampling_weights"):
        scripted.export_model(tmp_path / "stale")
    scripted.update_sampling_weights()
    exported = scripted.export_model(tmp_path / "fresh")
    assert (exported / "config.json").is_file()
    assert (exported / "tokenizer_config.json").is_file(), "the holder's tokenizer completes an export without one"


def test_training_needs_a_datum() -> None:
    with pytest.raises(ValueError, match="at least one datum"):
        holder().train([], TrainStepConfig(loss_fn="importance_sampling"))


def test_sampling_from_given_weights_does_not_count_as_the_trained_ones(tmp_path: Path) -> None:
    scripted = holder()
    scripted.update_sampling_weights("scripted://someone_elses")
    with pytest.raises(ModelExportError, match="sampling was pointed at other weights"):
        scripted.export_model(tmp_path)
    assert scripted.published == []
