"""`SdkServiceHolder`: the skeleton every service holder on a vendor SDK shares.

A holder on an SDK (``tinker``, ``nex-weaver``) talks to the hosted API and to NexRL's
local service alike, and most of what it does is the same whatever the SDK. It pickles
to its config and the current sampling weights and reconnects on first use. It renders
chats with the model's template (`nexrl_core.chat.holder.TemplateChat`), merges a
group's concurrent sample requests into one (`nexrl_core.training.coalesce.SampleCoalescer`) and
reads each sampled sequence into a `SampleResult` the same way. It retries transient
errors with backoff, naming the service in what it reports. It asks a NexRL service
what it honours and, for a hosted one, refuses before step 1 and by recipe key what
that service cannot compute. It exports only the weights sampling uses, completed with
the tokenizer. Written once here, the two holders cannot drift apart; a subclass
supplies only its SDK's side: the clients, how a sample request and a training step
travel, and what its hosted service computes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Generic, Literal, TypeVar

import attrs

from nexrl_core.chat.holder import TemplateChat, TemplateChatModel
from nexrl_core.chat.model import SamplingOptions
from nexrl_core.http.capabilities import NexrlCapabilities, probe_nexrl_capabilities
from nexrl_core.training.coalesce import SampleCoalescer
from nexrl_core.training.holders import LossOptionValue, TrainStepConfig, fixed_precision_refusals, service_run_info
from nexrl_core.training.model_export import HF_CONFIG_FILE, ModelExportError
from nexrl_core.types import RemoteDatum, SampleResult
from nexrl_remote_api.retries import RetriesExhausted, call_with_retries
from nexrl_remote_api.sdk_holder_config import SdkHolderConfig

__all__ = ["HOSTED_AGGREGATION", "SampledSequence", "SdkServiceHolder"]

ConfigT = TypeVar("ConfigT", bound=SdkHolderConfig)
T = TypeVar("T")

HOSTED_AGGREGATION = "token-sum"
"""Hosted services follow the Tinker design: a loss is a sum over tokens."""


@attrs.frozen
class SampledSequence:
    """One sequence of a sample answer, read out of the SDK's own shape."""

    tokens: list[int]
    logprobs: list[float]
    """One per token, or fewer when the service left them out (which `SdkServiceHolder` refuses)."""
    stop_reason: str | None
    """``length`` when ``max_tokens`` ended it; anything else is a stop."""


class SdkServiceHolder(TemplateChatModel, Generic[ConfigT]):
    """A `nexrl_core.training.holders.ServiceHolder` on a vendor SDK; subclasses supply the SDK's side.

    It pickles to its config plus the current sampling weights and reconnects on first
    use, so a copy sent to another process samples from the same weights.
    """

    api: ClassVar[str]
    """How messages name the API (``Tinker``)."""
    default_url_name: ClassVar[str] = "the default URL"
    """How messages name where the SDK connects when ``base_url`` is None."""
    hosted_losses: ClassVar[frozenset[str]]
    """The losses the hosted service computes (NexRL's local service has every registered one)."""

    def __init__(self, config: ConfigT, sampling_path: str | None = None) -> None:
        self.config = config
        self._sampling_path = sampling_path
        self._lock = threading.RLock()
        self._service: Any = None
        self._training: Any = None
        self._sampling: Any = None
        self._reference: Any = None
        self._tokenizer: Any = None
        self._saves = 0
        self._service_capabilities: NexrlCapabilities | None = None
        self._probed = False
        self._samples_trained_weights = sampling_path is None
        """Whether sampling uses the training model's current weights (what an export
        writes): true after publishing them, false after a step or a load."""
        self._chat = TemplateChat(self.tokenizer, self._chat_renderer)
        self._coalescer: SampleCoalescer[SampledSequence] = SampleCoalescer(self._send_sample, config.coalesce_window_s)

    # --- pickling and connection ---------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        return {"config": self.config, "sampling_path": self._sampling_path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["config"], state["sampling_path"])  # type: ignore[misc]

    @property
    def base_url(self) -> str | None:
        """Where the holder connects; None is the SDK's default."""
        return self.config.base_url

    def _where(self) -> str:
        return f"the {self.api} service at {self.base_url or self.default_url_name}"

    def _service_client(self) -> Any:
        """The SDK's client of the service, made once (under the lock)."""
        raise NotImplementedError

    def _training_client(self) -> Any:
        """The SDK's client of the model this holder trains, made once (under the lock)."""
        raise NotImplementedError

    def _sampling_client_of(self, path: str) -> Any:
        """A new SDK sampling client of the weights saved at ``path``."""
        raise NotImplementedError

    def _new_reference_client(self) -> Any:
        """A new SDK sampling client of the base model's weights."""
        raise NotImplementedError

    def _close_service(self, service: Any) -> None:
        """End the SDK's service client (its session)."""
        raise NotImplementedError

    def _auth_headers(self) -> Mapping[str, str]:
        """The API key as the service reads it, for the capabilities probe."""
        raise NotImplementedError

    def _sampling_client(self) -> Any:
        with self._lock:
            if self._sampling is None:
                if self._sampling_path is None:
                    self.update_sampling_weights()
                else:
                    self._sampling = self._sampling_client_of(self._sampling_path)
            return self._sampling

    def _reference_client(self) -> Any:
        with self._lock:
            if self._reference is None:
                self._reference = self._retry("create a reference sampling client", self._new_reference_client)
            return self._reference

    def tokenizer(self) -> Any:
        """The model's tokenizer: from ``tokenizer_path`` (with ``transformers``, which every
        SDK holder's distribution installs), else the one the service names."""
        with self._lock:
            if self._tokenizer is None:
                if self.config.tokenizer_path:
                    from transformers import AutoTokenizer

                    self._tokenizer = AutoTokenizer.from_pretrained(self.config.tokenizer_path)
                else:
                    self._tokenizer = self._service_tokenizer()
                self._tokenizer_loaded(self._tokenizer)
            return self._tokenizer

    def _service_tokenizer(self) -> Any:
        """The tokenizer the service names, as the SDK loads it (a subclass may find it first
        where no network is needed)."""
        return self._training_client().get_tokenizer()

    def _tokenizer_loaded(self, tokenizer: Any) -> None:
        """Called once, under the lock, with the tokenizer just loaded: what else needs
        it (a chat renderer) is built here."""

    def _chat_renderer(self) -> Any:
        """A renderer replacing the tokenizer's chat template (`TemplateChat`), or None."""
        return None

    def _retry(self, what: str, call: Callable[[], T]) -> T:
        """Run ``call``, retrying transient service errors with exponential backoff; any
        other failure is raised as `_failure` words it (as it came, where that is None).

        :raises RetriesExhausted: after ``max_retries`` retries, naming the service.
        """
        try:
            return call_with_retries(
                call,
                what=what,
                where=self._where(),
                is_transient=self._is_transient,
                max_retries=self.config.max_retries,
                backoff_s=self.config.retry_backoff_s,
            )
        except RetriesExhausted:
            raise
        except Exception as exc:
            failure = self._failure(what, exc)
            if failure is None:
                raise
            raise failure from exc

    def _is_transient(self, error: BaseException) -> bool:
        """Whether the SDK's ``error`` may pass on a retry (a connection, a timeout, a 5xx)."""
        raise NotImplementedError

    def _failure(self, what: str, error: BaseException) -> BaseException | None:
        """The error to raise for ``error``, which retrying will not fix, saying what the
        holder was doing and where; None raises ``error`` as it came."""
        return None

    # --- sampling (chat templates: `TemplateChatModel`) --------------------------------------

    def _sampling_fields(self, options: SamplingOptions) -> dict[str, Any]:
        """Every SDK's ``SamplingParams`` fields for ``options``; no ``stop`` stops at the end
        of the assistant's turn."""
        return {
            "max_tokens": options.max_tokens,
            "temperature": options.temperature,
            "top_p": options.top_p,
            "top_k": options.top_k,
            "seed": options.seed,
            "stop": list(options.stop) if options.stop is not None else self._chat.default_stop(),
        }

    def _send_sample(self, prompt: list[int], options: SamplingOptions, num_samples: int) -> list[SampledSequence]:
        """``num_samples`` sequences of ``prompt`` in one request (`SampleCoalescer` calls it)."""
        raise NotImplementedError

    def sample_from_prompt(self, prompt_tokens: Sequence[int], options: SamplingOptions) -> SampleResult:
        prompt = [int(token) for token in prompt_tokens]
        sequence = self._coalescer.sample(prompt, options)
        if len(sequence.logprobs) != len(sequence.tokens):
            raise RuntimeError(
                f"{self.api} returned {len(sequence.tokens)} tokens but {len(sequence.logprobs)} logprobs; sampling logprobs are required"
            )
        finish_reason: Literal["stop", "length"] = "length" if sequence.stop_reason == "length" else "stop"
        return self._chat.sample_result(prompt, sequence.tokens, sequence.logprobs, finish_reason)

    # --- training ----------------------------------------------------------------------------

    def train(self, datums: Sequence[RemoteDatum], config: TrainStepConfig) -> dict[str, float]:
        if not datums:
            raise ValueError("train needs at least one datum")
        data = [self._datum(datum, config.loss_fn) for datum in datums]
        loss_fn_config = dict(config.loss_fn_config) if self.is_nexrl_service() else self._hosted_loss_config(config)
        training = self._training_client()
        with self._lock:
            self._samples_trained_weights = False
        return self._train_step(training, data, config, loss_fn_config)

    def _datum(self, datum: RemoteDatum, loss_fn: str) -> Any:
        """The SDK's datum of ``datum`` for ``loss_fn``."""
        raise NotImplementedError

    def _hosted_loss_config(self, config: TrainStepConfig) -> dict[str, float]:
        """What the hosted service takes of the step's loss options (`refused_options` has
        refused the rest)."""
        raise NotImplementedError

    def _train_step(self, training: Any, data: list[Any], config: TrainStepConfig, loss_fn_config: dict[str, Any]) -> dict[str, float]:
        """One forward-backward and optimizer step with ``config.optimizer``; their metrics."""
        raise NotImplementedError

    # The rest of `ServiceHolder` (documented there), which each SDK's holder implements with its own calls.

    def reference_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        raise NotImplementedError

    def update_sampling_weights(self, weight_path: str | None = None) -> str:
        raise NotImplementedError

    def save_checkpoint(self, name: str) -> str:
        raise NotImplementedError

    def load_checkpoint(self, path: str) -> None:
        raise NotImplementedError

    def service_capabilities(self) -> NexrlCapabilities | None:
        """What a NexRL service says it does (every registered loss with all its options,
        in the precision it names); None for a hosted service, which says nothing."""
        with self._lock:
            if not self._probed:
                self._service_capabilities = probe_nexrl_capabilities(self.base_url, self._auth_headers(), self.api)
                self._probed = True
            return self._service_capabilities

    def is_nexrl_service(self) -> bool:
        return self.service_capabilities() is not None

    def run_info(self) -> dict[str, str]:
        return service_run_info(self.service_capabilities())

    def refused_options(self, config: TrainStepConfig) -> dict[str, str]:
        refused = fixed_precision_refusals(self.config.model, self.api, self.service_capabilities())
        if self.is_nexrl_service():
            return refused
        if config.loss_fn not in self.hosted_losses:
            refused["loss_fn"] = f"hosted {self.api} computes only {', '.join(sorted(self.hosted_losses))}"
            return refused
        for option, value in config.loss_fn_config.items():
            if option == "agg_mode":
                reason = None
                if value != HOSTED_AGGREGATION:
                    reason = f"hosted {self.api} sums the loss over tokens; set it to {HOSTED_AGGREGATION}"
            else:
                reason = self._hosted_option_refusal(config.loss_fn, option, value)
            if reason is not None:
                refused[f"loss_fn_config.{option}"] = reason
        return refused

    def _hosted_option_refusal(self, loss_fn: str, option: str, value: LossOptionValue) -> str | None:
        """Why the hosted service cannot honour ``option`` (not ``agg_mode``) of ``loss_fn``, or None."""
        raise NotImplementedError

    def _no_such_option(self, loss_fn: str) -> str:
        return f"hosted {self.api}'s {loss_fn!r} loss has no such option; remove it"

    def _next_sampler_name(self) -> str:
        """A fresh name for the sampler weights `update_sampling_weights` saves."""
        name = f"sampler_{self._saves:06d}"
        self._saves += 1
        return name

    # --- the model as a whole ----------------------------------------------------------------

    def export_model(self, directory: Path) -> Path:
        """Download the weights sampling uses through the SDK's own export API
        (`_export_weights`, then `_download_export`). A tokenizer the service leaves out
        comes from this holder's tokenizer.

        :raises ModelExportError: when sampling does not use the training weights (a
            step since the last `update_sampling_weights`), or the download fails or is
            not a full HF model.
        """
        directory = Path(directory)
        with self._lock:
            if not self._samples_trained_weights:
                raise ModelExportError(
                    "sampling does not use the training weights (they changed since the last update_sampling_weights, "
                    "or sampling was pointed at other weights); call update_sampling_weights() first"
                )
            export = self._export_weights(self._training_client())
        source = self._download_export(export, directory)
        if not (directory / HF_CONFIG_FILE).is_file():
            raise ModelExportError(f"{source} has no {HF_CONFIG_FILE}, so it is not a full Hugging Face model")
        if not (directory / "tokenizer_config.json").is_file():
            self.tokenizer().save_pretrained(str(directory))
        return directory

    def _export_weights(self, training: Any) -> Any:
        """Have the service export the training weights (under the lock); what names the export."""
        raise NotImplementedError

    def _download_export(self, export: Any, directory: Path) -> str:
        """Fetch every file of ``export`` into ``directory``; how messages name the export.

        :raises ModelExportError: when the service's export cannot be downloaded.
        """
        raise NotImplementedError

    def close(self) -> None:
        with self._lock:
            service, self._service = self._service, None
            self._training = self._sampling = self._reference = None
        if service is not None:
            self._close_service(service)
