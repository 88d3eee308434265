"""`TinkerServiceHolder`: sampling and training through the real ``tinker`` SDK.

The same holder talks to Thinking Machines' hosted Tinker (``base_url`` and
``TINKER_API_KEY``) and to NexRL's local Tinker-compatible service; nothing here knows
which. One instance serves the rollout workers and the trainer, so sampling always uses
the weights the trainer last published.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from nexrl_core.chat_holder import TemplateChat, TemplateChatModel
from nexrl_core.chat_model import SamplingOptions
from nexrl_core.coalesce import SampleCoalescer
from nexrl_core.capabilities import NexrlCapabilities, probe_nexrl_capabilities
from nexrl_core.holders import TrainStepConfig, fixed_precision_refusals, service_run_info
from nexrl_core.retries import RetriesExhausted, call_with_retries
from nexrl_core.model_export import HF_CONFIG_FILE, ModelExportError
from nexrl_core.types import RemoteDatum, SampleResult
from nexrl_tinker.holder_config import TinkerHolderConfig

logger = logging.getLogger(__name__)
T = TypeVar("T")

RL_LOSSES = frozenset({"importance_sampling", "ppo", "cispo", "gspo"})
"""Losses that read the sampler's logprobs and per-token advantages."""
HOSTED_LOSSES = frozenset({"cross_entropy", "importance_sampling", "ppo", "cispo"})
"""The losses hosted Tinker computes itself (NexRL's local service has every registered one)."""
CLIPPED_LOSSES = frozenset({"ppo", "cispo"})
"""Tinker losses that take ``clip_low_threshold`` / ``clip_high_threshold`` (ratio bounds)."""
HOSTED_AGGREGATION = "token-sum"
"""Hosted Tinker's losses are sums over tokens."""
DOWNLOAD_TIMEOUT_S = 300.0
"""Per file of an exported model, for the signed-URL downloads."""


def _transient_errors() -> tuple[type[BaseException], ...]:
    import tinker

    return (tinker.APIConnectionError, tinker.APITimeoutError, tinker.InternalServerError, tinker.RateLimitError)


class TinkerServiceHolder(TemplateChatModel):
    """A `nexrl_core.holders.ServiceHolder` on the ``tinker`` SDK.

    It pickles to its config plus the current sampling weights and reconnects on first
    use, so a copy sent to another process samples from the same weights.
    """

    def __init__(self, config: TinkerHolderConfig, sampling_path: str | None = None) -> None:
        self.config = config
        self._sampling_path = sampling_path
        self._lock = threading.RLock()
        self._service: Any = None
        self._training: Any = None
        self._sampling: Any = None
        self._tokenizer: Any = None
        self._renderer: Any = None
        self._saves = 0
        self._samples_trained_weights = sampling_path is None
        """Whether sampling uses the training client's current weights (what an export
        writes): true after publishing them, false after a step or a load."""
        self._reference: Any = None
        self._service_capabilities: NexrlCapabilities | None = None
        self._probed = False
        self._chat = TemplateChat(self.tokenizer, self._chat_renderer)
        self._coalescer: SampleCoalescer[Any] = SampleCoalescer(self._send_sample, config.coalesce_window_s)

    # --- pickling and connection ---------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        return {"config": self.config, "sampling_path": self._sampling_path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["config"], state["sampling_path"])  # type: ignore[misc]

    def _service_client(self) -> Any:
        with self._lock:
            if self._service is None:
                import tinker

                self._service = tinker.ServiceClient(base_url=self.config.base_url, api_key=self.config.api_key)
            return self._service

    def _training_client(self) -> Any:
        lora = self.config.model.lora
        with self._lock:
            if self._training is None:
                self._training = self._retry(
                    "create a training client",
                    lambda: self._service_client()
                    .create_lora_training_client(
                        self.config.model.name,
                        rank=lora.rank,
                        seed=self.config.seed,
                        train_mlp=lora.train_mlp,
                        train_attn=lora.train_attn,
                        train_unembed=lora.train_unembed,
                    )
                    .result(),
                )
            return self._training

    def _sampling_client(self) -> Any:
        with self._lock:
            if self._sampling is None:
                if self._sampling_path is None:
                    self.update_sampling_weights()
                else:
                    self._sampling = self._service_client().create_sampling_client(model_path=self._sampling_path).result()
            return self._sampling

    def tokenizer(self) -> Any:
        """The model's tokenizer: from ``tokenizer_path``, else the one the service names."""
        with self._lock:
            if self._tokenizer is None:
                if self.config.tokenizer_path:
                    from transformers import AutoTokenizer

                    self._tokenizer = AutoTokenizer.from_pretrained(self.config.tokenizer_path)
                else:
                    self._tokenizer = self._training_client().get_tokenizer()
                if self.config.renderer_name:
                    self._renderer = _cookbook_renderer(self.config.renderer_name, self._tokenizer)
            return self._tokenizer

    def _chat_renderer(self) -> Any:
        """The tinker-cookbook renderer of ``renderer_name``, or None for the tokenizer's template."""
        self.tokenizer()
        return self._renderer

    def _retry(self, what: str, call: Callable[[], T]) -> T:
        """Run ``call``, retrying transient service errors with exponential backoff."""
        transient = _transient_errors()
        return call_with_retries(
            call,
            what=what,
            where=f"the Tinker service at {self.config.base_url or 'the default URL'}",
            is_transient=lambda error: isinstance(error, transient),
            max_retries=self.config.max_retries,
            backoff_s=self.config.retry_backoff_s,
        )

    # --- sampling (chat templates: `TemplateChatModel`) ------------------------------------- ------------------------------------------------------------------------------

    def _send_sample(self, prompt: list[int], options: SamplingOptions, num_samples: int) -> list[Any]:
        """``num_samples`` Tinker sequences of ``prompt`` in one request."""
        import tinker

        params = tinker.types.SamplingParams(
            max_tokens=options.max_tokens,
            temperature=options.temperature,
            top_p=options.top_p,
            top_k=options.top_k,
            seed=options.seed,
            stop=list(options.stop) if options.stop is not None else self._chat.default_stop(),
        )
        model_input = tinker.types.ModelInput.from_ints(tokens=prompt)
        response = self._retry(
            "sample",
            lambda: self._sampling_client().sample(model_input, num_samples=num_samples, sampling_params=params).result(),
        )
        return list(response.sequences)

    def sample_from_prompt(self, prompt_tokens: Sequence[int], options: SamplingOptions) -> SampleResult:
        prompt = [int(token) for token in prompt_tokens]
        sequence = self._coalescer.sample(prompt, options)
        tokens = [int(token) for token in sequence.tokens]
        logprobs = [float(value) for value in sequence.logprobs or []]
        if len(logprobs) != len(tokens):
            raise RuntimeError(f"Tinker returned {len(tokens)} tokens but {len(logprobs)} logprobs; sampling logprobs are required")
        finish_reason = "length" if sequence.stop_reason == "length" else "stop"
        return self._chat.sample_result(prompt, tokens, logprobs, finish_reason)

    # --- training ------------------------------------------------------------------------------

    def train(self, datums: Sequence[RemoteDatum], config: TrainStepConfig) -> dict[str, float]:
        import tinker

        if not datums:
            raise ValueError("train needs at least one datum")
        data = [_to_tinker_datum(datum, config.loss_fn) for datum in datums]
        loss_fn_config = dict(config.loss_fn_config) if self.is_nexrl_service() else _hosted_loss_config(config)
        adam = tinker.types.AdamParams(**config.optimizer.to_json())
        training = self._training_client()
        self._samples_trained_weights = False

        backward = training.forward_backward(data, config.loss_fn, loss_fn_config or None)
        optimizer = training.optim_step(adam)
        metrics = {key: float(value) for key, value in self._result("run forward_backward", backward).metrics.items()}
        metrics.update({key: float(value) for key, value in (self._result("run an optimizer step", optimizer).metrics or {}).items()})
        return metrics

    def _result(self, what: str, future: Any) -> Any:
        """The result of a training request the SDK sent; the holder never sends it again.

        The tinker SDK itself re-sends a submission that failed with the request's own
        ``seq_id`` (for five minutes) and polls again for a result whose answer was lost
        (for as long as it takes), and the service answers a ``(model, seq_id)`` it took
        already with that request. Calling the SDK again would send a new ``seq_id``: a
        second request, applied on top of the first whenever the first got through. So
        a transient error that outlasts the SDK's own retries stops the step
        (``nexrl train --resume`` goes on from the last checkpoint).

        :raises RetriesExhausted: for a transient error, naming the request.
        """
        try:
            return future.result()
        except _transient_errors() as error:
            raise RetriesExhausted(
                f"the Tinker service at {self.config.base_url or 'the default URL'} failed to {what} after the tinker SDK's "
                f"own retries: {type(error).__name__}: {error}; the holder does not send it again, since the service "
                f"may have applied it already"
            ) from error

    def service_capabilities(self) -> NexrlCapabilities | None:
        """What a NexRL service says it does (every registered loss with all its options,
        in the precision it names); None for hosted Tinker, which says nothing."""
        with self._lock:
            if not self._probed:
                headers = {"X-API-Key": self.config.api_key} if self.config.api_key else {}
                self._service_capabilities = probe_nexrl_capabilities(self.config.base_url, headers, "Tinker")
                self._probed = True
            return self._service_capabilities

    def is_nexrl_service(self) -> bool:
        return self.service_capabilities() is not None

    def run_info(self) -> dict[str, str]:
        return service_run_info(self.service_capabilities())

    def refused_options(self, config: TrainStepConfig) -> dict[str, str]:
        refused = fixed_precision_refusals(self.config.model, "Tinker", self.service_capabilities())
        if self.is_nexrl_service():
            return refused
        if config.loss_fn not in HOSTED_LOSSES:
            refused["loss_fn"] = f"hosted Tinker computes only {', '.join(sorted(HOSTED_LOSSES))}"
            return refused
        for option, value in config.loss_fn_config.items():
            if option in ("clip_low", "clip_high") and config.loss_fn in CLIPPED_LOSSES:
                continue
            if option == "agg_mode":
                if value != HOSTED_AGGREGATION:
                    refused[f"loss_fn_config.{option}"] = f"hosted Tinker sums the loss over tokens; set it to {HOSTED_AGGREGATION}"
            elif option == "entropy_coeff":
                if value != 0:
                    refused[f"loss_fn_config.{option}"] = "hosted Tinker's losses have no entropy bonus; set it to 0"
            else:
                refused[f"loss_fn_config.{option}"] = f"hosted Tinker's {config.loss_fn!r} loss has no such option; remove it"
        return refused

    def reference_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Logprobs under the base model, from a sampling client of the base weights
        (``compute_logprobs``), as tinker-cookbook computes its KL reference."""
        import tinker

        with self._lock:
            if self._reference is None:
                self._reference = self._retry(
                    "create a reference sampling client",
                    lambda: self._service_client().create_sampling_client(base_model=self.config.model.name).result(),
                )
            reference = self._reference
        futures = [reference.compute_logprobs(tinker.types.ModelInput.from_ints(tokens=list(tokens))) for tokens in sequences]
        return [[0.0 if value is None else float(value) for value in future.result()] for future in futures]

    def update_sampling_weights(self, weight_path: str | None = None) -> str:
        with self._lock:
            if weight_path is None:
                name = f"sampler_{self._saves:06d}"
                self._saves += 1
                training = self._training_client()
                weight_path = self._retry("save sampler weights", lambda: training.save_weights_for_sampler(name).result().path)
                self._samples_trained_weights = True
            else:
                self._samples_trained_weights = False
            assert weight_path is not None
            self._sampling = self._service_client().create_sampling_client(model_path=weight_path).result()
            self._sampling_path = weight_path
            return weight_path

    def save_checkpoint(self, name: str) -> str:
        training = self._training_client()
        return str(self._retry("save a checkpoint", lambda: training.save_state(name).result().path))

    def load_checkpoint(self, path: str) -> None:
        with self._lock:
            self._samples_trained_weights = False
            self._training = self._retry(
                "load a checkpoint",
                lambda: self._service_client().create_training_client_from_state_with_optimizer(path).result(),
            )

    def export_model(self, directory: Path) -> Path:
        """Download the weights sampling uses through Tinker's own API: the training
        client saves them as external weights (``save_weights_external``), the REST
        client signs one URL per file (``get_external_weights_urls``), each file is
        fetched with a plain GET, and the export is deleted from the service again. A
        tokenizer the service leaves out comes from this holder's tokenizer.

        :raises ModelExportError: when sampling does not use the training weights (a
            step since the last `update_sampling_weights`), or the download fails or
            is not a full HF model.
        """
        import tinker

        directory = Path(directory)
        with self._lock:
            if not self._samples_trained_weights:
                raise ModelExportError(
                    "sampling does not use the training weights (they changed since the last update_sampling_weights, "
                    "or sampling was pointed elsewhere); call update_sampling_weights() first"
                )
            training = self._training_client()
            name = f"nexrl_export_{secrets.token_hex(4)}"
            export_path = self._retry("export the weights", lambda: training.save_weights_external(name).result().path)
        rest = tinker.RestClient(base_url=self.config.base_url, api_key=self.config.api_key)
        try:
            signed = self._retry("sign download URLs", lambda: rest.get_external_weights_urls(export_path).result())
            _download_files(signed.urls, directory, export_path)
        finally:
            try:
                rest.delete_checkpoint_from_tinker_path(export_path).result()
            except Exception as exc:  # the download is what matters; the export expires with its service
                logger.warning("could not delete the temporary export %s from the service: %s", export_path, exc)
        if not (directory / HF_CONFIG_FILE).is_file():
            raise ModelExportError(
                f"the service's export {export_path} has no {HF_CONFIG_FILE} (files: {', '.join(sorted(signed.urls))}), "
                f"so it is not a full Hugging Face model"
            )
        if not (directory / "tokenizer_config.json").is_file():
            self.tokenizer().save_pretrained(str(directory))
        return directory

    def close(self) -> None:
        with self._lock:
            service, self._service = self._service, None
            self._training = self._sampling = self._reference = None
        if service is not None:
            service.close("success").result()


def _download_files(urls: dict[str, str], directory: Path, export_path: str) -> None:
    """Fetch each signed URL to its relative path below ``directory``."""
    import httpx

    if not urls:
        raise ModelExportError(f"the service's export {export_path} has no files")
    root = directory.resolve()
    for relative, url in sorted(urls.items()):
        target = (root / relative).resolve()
        if not target.is_relative_to(root):
            raise ModelExportError(f"the service's export {export_path} names a file outside its directory: {relative!r}")
        target.parent.mkdir(parents=True, exist_ok=True)
        with httpx.stream("GET", url, timeout=DOWNLOAD_TIMEOUT_S) as response:
            if response.status_code != 200:
                response.read()
                raise ModelExportError(
                    f"downloading {relative} of {export_path} failed: HTTP {response.status_code}: {response.text[:300]}"
                )
            with target.open("wb") as file:
                for chunk in response.iter_bytes():
                    file.write(chunk)


def _tensor(values: Sequence[float] | Sequence[int], dtype: str) -> Any:
    import tinker

    return tinker.types.TensorData(data=list(values), dtype=dtype, shape=[len(values)])


def _to_tinker_datum(datum: RemoteDatum, loss_fn: str) -> Any:
    """A Tinker datum: cross-entropy reads weights; the RL losses read sampler logprobs and
    advantages, which are already zero wherever the loss mask is."""
    import tinker

    inputs = {"target_tokens": _tensor(datum.target_tokens, "int64")}
    if loss_fn in RL_LOSSES:
        inputs["logprobs"] = _tensor(datum.sampling_logprobs, "float32")
        inputs["advantages"] = _tensor(datum.advantages, "float32")
    elif loss_fn == "cross_entropy":
        inputs["weights"] = _tensor(datum.loss_mask, "float32")
    else:
        raise ValueError(f"Tinker has no loss {loss_fn!r}; use one of cross_entropy, {', '.join(sorted(RL_LOSSES))}")
    return tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(tokens=list(datum.input_tokens)), loss_fn_inputs=inputs)


def _hosted_loss_config(config: TrainStepConfig) -> dict[str, float]:
    """NexRL's clip widths (``clip_low``/``clip_high``, as in PPO papers) as hosted Tinker's
    ratio bounds; `TinkerServiceHolder.refused_options` has refused every other option
    that would change the loss."""
    if config.loss_fn not in CLIPPED_LOSSES:
        return {}
    options = config.loss_fn_config
    bounds = {}
    if "clip_low" in options:
        bounds["clip_low_threshold"] = 1.0 - float(options["clip_low"])
    if "clip_high" in options:
        bounds["clip_high_threshold"] = 1.0 + float(options["clip_high"])
    return bounds


def _cookbook_renderer(name: str, tokenizer: Any) -> Any:
    try:
        from tinker_cookbook import renderers
    except ImportError as exc:
        raise ValueError(
            f"renderer_name {name!r} needs tinker-cookbook: pip install --no-deps tinker-cookbook (see the README)"
        ) from exc
    return renderers.get_renderer(name, tokenizer)
