"""`WeaverServiceHolder`: sampling and training through the real ``nex-weaver`` SDK.

The same holder talks to hosted Weaver (``WEAVER_BASE_URL`` / ``WEAVER_API_KEY``) and
to NexRL's local Weaver-compatible service; nothing here knows which, except for the
losses and options it may send (`WeaverServiceHolder.refused_options`). One instance
serves the rollout workers and the trainer, so sampling always uses the weights the
trainer last published. Chat templates, default stops and tool-call parsing are
`nexrl_core.chat_holder.TemplateChat`, shared with every other holder.

The SDK waits for an operation without a deadline and polls with a back-off that
grows to 10 s; the holder submits with ``wait=False`` and waits itself (`_wait`):
quick polls, and a clear error after ``operation_timeout_s``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
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
from nexrl_weaver.holder_config import WeaverHolderConfig

logger = logging.getLogger(__name__)
T = TypeVar("T")

RL_LOSSES = frozenset({"importance_sampling", "ppo", "cispo", "gspo"})
"""Losses that read the sampler's logprobs and per-token advantages."""
HOSTED_LOSSES = frozenset({"cross_entropy", "importance_sampling"})
"""The losses hosted Weaver computes (NexRL's local service has every registered one)."""
HOSTED_OPTIONS = frozenset({"entropy_coeff"})
"""Loss options hosted Weaver takes (NexRL's own Weaver holder sends this one)."""
HOSTED_AGGREGATION = "token-sum"
"""Hosted Weaver follows the Tinker design: a loss is a sum over tokens."""
EXPORT_TTL_S = 3600
"""How long the service keeps an export: the holder downloads it at once, and the Weaver
API has no call to delete one."""
API_KEY_ENV = "WEAVER_API_KEY"
BASE_URL_ENV = "WEAVER_BASE_URL"


class WeaverServiceHolder(TemplateChatModel):
    """A `nexrl_core.holders.ServiceHolder` on the ``nex-weaver`` SDK.

    It pickles to its config plus the current sampling weights and reconnects on first
    use, so a copy sent to another process samples from the same weights.
    """

    def __init__(self, config: WeaverHolderConfig, sampling_path: str | None = None) -> None:
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
        """Whether sampling uses the training model's current weights, which is what an
        export of the current weights writes."""
        self._chat = TemplateChat(self.tokenizer)
        self._coalescer: SampleCoalescer[Any] = SampleCoalescer(self._send_sample, config.coalesce_window_s)

    # --- pickling and connection ---------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        return {"config": self.config, "sampling_path": self._sampling_path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["config"], state["sampling_path"])  # type: ignore[misc]

    @property
    def base_url(self) -> str | None:
        """Where the holder connects; None is the SDK's hosted default."""
        return self.config.base_url or os.environ.get(BASE_URL_ENV) or None

    def _service_client(self) -> Any:
        with self._lock:
            if self._service is None:
                from weaver import ServiceClient

                api_key = self.config.api_key or os.environ.get(API_KEY_ENV) or None
                if self.base_url is None and api_key is None:
                    raise ValueError(
                        f"hosted Weaver needs an API key: set {API_KEY_ENV} (or backend.options.api_key_env), "
                        f"or point {BASE_URL_ENV} / backend.options.base_url at a service that needs none"
                    )
                client = ServiceClient(
                    base_url=self.base_url, api_key=api_key, tensor_transport=self.config.tensor_transport  # type: ignore[arg-type]
                )
                self._retry("connect", client.connect)
                self._service = client
            return self._service

    def _training_client(self) -> Any:
        with self._lock:
            if self._training is None:
                from weaver.types import LoraConfig

                model = self.config.model
                lora = model.lora
                options: dict[str, Any] = {"training_mode": "full_ft"}
                if lora.is_lora:
                    config = LoraConfig(
                        rank=lora.rank,
                        seed=self.config.seed,
                        train_mlp=lora.train_mlp,
                        train_attn=lora.train_attn,
                        train_unembed=lora.train_unembed,
                    )
                    options = {"training_mode": "lora", "lora_config": config}
                service = self._service_client()
                self._training = self._retry(
                    "create a model", lambda: service.create_model(base_model=model.name, **options)
                )
            return self._training

    def _sampling_client(self) -> Any:
        with self._lock:
            if self._sampling is None:
                if self._sampling_path is None:
                    self.update_sampling_weights()
                else:
                    path = self._sampling_path
                    self._sampling = self._retry(
                        "create a sampling client",
                        lambda: self._service_client().create_sampling_client(model_path=path, base_model=self.config.model.name),
                    )
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
            return self._tokenizer

    def _retry(self, what: str, call: Callable[[], T]) -> T:
        """Run ``call``, retrying transient service errors with exponential backoff; any
        other failure is reported with what the holder was doing and where."""
        try:
            return call_with_retries(
                call,
                what=what,
                where=f"the Weaver service at {self.base_url or 'the hosted default URL'}",
                is_transient=_is_transient,
                max_retries=self.config.max_retries,
                backoff_s=self.config.retry_backoff_s,
            )
        except RetriesExhausted:
            raise
        except Exception as exc:
            raise _service_error(what, self.base_url, exc) from exc

    def _wait(self, what: str, submit: Callable[[], Any]) -> Any:
        """Submit an operation (``wait=False``) and wait for its response, at most
        ``operation_timeout_s``. A submission that answers with its finished result (no
        operation handle) returns it.

        A transient failure of the submission calls ``submit`` again; one while waiting
        polls the same operation again and never submits anew, since the operation may
        have run already (the connection broke after the service took it). A training
        step's ``submit`` re-sends the same body, its ``seq_id`` included
        (`_training_operation`), so the service answers it with the operation it already
        started: no retry applies a step twice."""
        handle = self._retry(what, submit)
        if not hasattr(handle, "done"):
            return handle
        deadline = time.monotonic() + self.config.operation_timeout_s

        def result() -> Any:
            delay = 0.002
            while not handle.done():
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"operation {handle.operation_id} did not finish within {self.config.operation_timeout_s:g} s "
                        f"(raise operation_timeout_s for long operations)"
                    )
                time.sleep(delay)
                delay = min(delay * 2, 0.25)
                handle.refresh()
            return handle.result()

        return self._retry(what, result)

    def _training_operation(self, what: str, route: str, prepared: Any) -> Any:
        """Run a prepared training operation (a ``weaver.tensor_transport.PreparedOperationBody``
        whose payload carries a ``seq_id``) on the training model: every attempt sends
        this same body, which the service keys on its ``(model, seq_id)``."""
        service = self._service_client()
        path = f"/api/v1/models/{self._training_client().model_id}/{route}"
        try:
            return self._wait(what, lambda: service.enqueue_operation(path, prepared.body, tensor_pack=prepared.tensor_pack))
        finally:
            prepared.close()

    # --- sampling (chat templates: `TemplateChatModel`) ------------------------------------- ------------------------------------------------------------------------------

    def _send_sample(self, prompt: list[int], options: SamplingOptions, num_samples: int) -> list[dict[str, Any]]:
        """``num_samples`` Weaver sequences of ``prompt`` in one operation."""
        from weaver.types import ModelInput, SamplingParams

        stop = list(options.stop) if options.stop is not None else self._chat.default_stop()
        params = SamplingParams(
            max_tokens=options.max_tokens,
            temperature=options.temperature,
            top_p=options.top_p,
            top_k=options.top_k,
            stop=stop,
            seed=options.seed,
        )
        model_input = ModelInput.from_ints(prompt)
        response = self._wait(
            "sample",
            lambda: self._sampling_client().sample(prompt=model_input, sampling_params=params, num_samples=num_samples, wait=False),
        )
        sequences = (response or {}).get("result", {}).get("sequences") or (response or {}).get("sequences")
        if not isinstance(sequences, list) or len(sequences) != num_samples:
            raise RuntimeError(f"Weaver returned {len(sequences or [])} sequences for {num_samples} samples: {response!r:.300}")
        return sequences

    def sample_from_prompt(self, prompt_tokens: Sequence[int], options: SamplingOptions) -> SampleResult:
        prompt = [int(token) for token in prompt_tokens]
        sequence = self._coalescer.sample(prompt, options)
        tokens = [int(token) for token in sequence.get("tokens") or []]
        logprobs = [float(value) for value in sequence.get("logprobs") or []]
        if len(logprobs) != len(tokens):
            raise RuntimeError(f"Weaver returned {len(tokens)} tokens but {len(logprobs)} logprobs; sampling logprobs are required")
        finish_reason = "length" if sequence.get("stop_reason") == "length" else "stop"
        return self._chat.sample_result(prompt, tokens, logprobs, finish_reason)

    # --- training ------------------------------------------------------------------------------

    def train(self, datums: Sequence[RemoteDatum], config: TrainStepConfig) -> dict[str, float]:
        from weaver._payloads import prepare_forward_backward_operation
        from weaver.tensor_transport import PreparedOperationBody
        from weaver.types import AdamParams

        if not datums:
            raise ValueError("train needs at least one datum")
        data = [_to_weaver_datum(datum, config.loss_fn) for datum in datums]
        loss_fn_config = dict(config.loss_fn_config) if self.is_nexrl_service() else _hosted_loss_config(config)
        adam = AdamParams(**config.optimizer.to_json())
        training = self._training_client()
        with self._lock:
            self._samples_trained_weights = False
        # The bodies the SDK's forward_backward and optim_step send (built by its own
        # prepare_forward_backward_operation, which TrainingClient.forward_backward calls),
        # each with its seq_id taken once, so that a retry re-sends this step, not a new one.
        service = self._service_client()
        backward = self._training_operation(
            "run forward_backward",
            "forward-backward-passes",
            prepare_forward_backward_operation(
                model_id=training.model_id,
                seq_id=service.next_operation_seq(training.model_id),
                data=data,
                loss_fn=config.loss_fn,
                loss_fn_config=loss_fn_config or None,
                request_metadata=None,
                tensor_transport=service.tensor_transport,
                tensor_compression=service.tensor_compression,
            ),
        )
        step = {"model_id": training.model_id, "seq_id": service.next_operation_seq(training.model_id), "adam_params": adam.to_payload()}
        optimizer = self._training_operation("run an optimizer step", "optimizer-steps", PreparedOperationBody({"payload": step}))
        metrics = {key: float(value) for key, value in _metrics_of(backward).items()}
        metrics.update({f"optim/{key}": float(value) for key, value in _metrics_of(optimizer).items()})
        return metrics

    def service_capabilities(self) -> NexrlCapabilities | None:
        """What a NexRL service says it does (every registered loss with all its options,
        in the precision it names); None for hosted Weaver, which says nothing."""
        with self._lock:
            if not self._probed:
                api_key = self.config.api_key or os.environ.get(API_KEY_ENV)
                headers = {"X-WEAVER-API-KEY": api_key} if api_key else {}
                self._service_capabilities = probe_nexrl_capabilities(self.base_url, headers, "Weaver")
                self._probed = True
            return self._service_capabilities

    def is_nexrl_service(self) -> bool:
        return self.service_capabilities() is not None

    def run_info(self) -> dict[str, str]:
        return service_run_info(self.service_capabilities())

    def refused_options(self, config: TrainStepConfig) -> dict[str, str]:
        refused = fixed_precision_refusals(self.config.model, "Weaver", self.service_capabilities())
        if self.is_nexrl_service():
            return refused
        if config.loss_fn not in HOSTED_LOSSES:
            refused["loss_fn"] = f"hosted Weaver computes only {', '.join(sorted(HOSTED_LOSSES))}"
            return refused
        for option, value in config.loss_fn_config.items():
            if option == "agg_mode":
                if value != HOSTED_AGGREGATION:
                    refused[f"loss_fn_config.{option}"] = f"hosted Weaver sums the loss over tokens; set it to {HOSTED_AGGREGATION}"
            elif option not in HOSTED_OPTIONS:
                refused[f"loss_fn_config.{option}"] = f"hosted Weaver's {config.loss_fn!r} loss has no such option; remove it"
        return refused

    def reference_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Logprobs under the base model, from a sampling session of the base weights
        (``compute_logprobs``)."""
        from weaver.types import ModelInput

        with self._lock:
            if self._reference is None:
                self._reference = self._retry(
                    "create a reference sampling client",
                    lambda: self._service_client().create_sampling_client(base_model=self.config.model.name),
                )
            reference = self._reference
        results = []
        for tokens in sequences:
            values = self._retry("compute reference logprobs", lambda: reference.compute_logprobs(prompt=ModelInput.from_ints(list(tokens))))
            results.append([0.0 if value is None else float(value) for value in values])
        return results

    def update_sampling_weights(self, weight_path: str | None = None) -> str:
        with self._lock:
            trains_here = weight_path is None
            if weight_path is None:
                name = f"sampler_{self._saves:06d}"
                self._saves += 1
                training = self._training_client()
                response = self._wait("save sampler weights", lambda: training.save_weights_for_sampler(name=name, wait=False))
                weight_path = str((response or {}).get("model_path") or (response or {}).get("path") or "")
                if not weight_path:
                    raise RuntimeError(f"the Weaver service saved sampler weights but named no path: {response!r:.300}")
            self._samples_trained_weights = trains_here
            path = weight_path
            model_id = self._training.model_id if self._training is not None else None
            self._sampling = self._retry(
                "create a sampling client",
                lambda: self._service_client().create_sampling_client(
                    model_path=path, base_model=self.config.model.name, model_id=model_id
                ),
            )
            self._sampling_path = path
            return path

    def save_checkpoint(self, name: str) -> str:
        training = self._training_client()
        response = self._wait(
            "save a checkpoint", lambda: training.save_state(name=name, checkpoint_type="weight_and_optimizer", wait=False)
        )
        path = (response or {}).get("path")
        if not isinstance(path, str) or not path.startswith("weaver://"):
            raise RuntimeError(f"the Weaver service saved a checkpoint but returned no weaver:// path: {response!r:.300}")
        return path

    def load_checkpoint(self, path: str) -> None:
        training = self._training_client()
        with self._lock:
            self._samples_trained_weights = False
        self._wait("load a checkpoint", lambda: training.load_state_with_optimizer(path, wait=False))

    def export_model(self, directory: Path) -> Path:
        """Download the weights sampling uses through Weaver's own API: the training
        client exports its current weights (``export_weights``, LoRA merged into the base
        with ``merge_adapter``, which the local service writes with the adapter beside it
        under ``adapter/``) and the service client fetches every file of the artifact
        over its presigned URLs (``download_weights``, which checks each file's sha256).
        A tokenizer the service leaves out comes from this holder's tokenizer.

        :raises ModelExportError: when sampling does not use the training weights (a
            step since the last `update_sampling_weights`), or the download is not a
            full HF model.
        """
        from weaver.types import WeightsArtifact

        directory = Path(directory)
        merge = self.config.model.lora.is_lora
        with self._lock:
            if not self._samples_trained_weights:
                raise ModelExportError(
                    "sampling does not use the training weights (they changed since the last update_sampling_weights, "
                    "or sampling was pointed at other weights); call update_sampling_weights() first"
                )
            training = self._training_client()
            answer = self._wait(
                "export the weights",
                lambda: training.export_weights(merge_adapter=merge, ttl_seconds=EXPORT_TTL_S, wait=False),
            )
        artifact = answer if isinstance(answer, WeightsArtifact) else WeightsArtifact.from_payload(answer or {})
        if artifact.kind != "hf_model" or artifact.status not in (None, "completed"):
            raise ModelExportError(
                f"the Weaver service exported a {artifact.kind!r} artifact with status {artifact.status!r} "
                f"(error: {artifact.error}); a model export needs a completed 'hf_model'"
            )
        service = self._service_client()
        self._retry("download the exported weights", lambda: service.download_weights(artifact, directory))
        if not (directory / HF_CONFIG_FILE).is_file():
            raise ModelExportError(
                f"the Weaver service's artifact {artifact.id} has no {HF_CONFIG_FILE}, so it is not a full Hugging Face model"
            )
        if not (directory / "tokenizer_config.json").is_file():
            self.tokenizer().save_pretrained(str(directory))
        return directory

    def close(self) -> None:
        with self._lock:
            service, self._service = self._service, None
            self._training = self._sampling = self._reference = None
        if service is not None:
            service.close()


def _is_transient(exc: BaseException) -> bool:
    import httpx
    from weaver import WeaverAPIError

    if isinstance(exc, WeaverAPIError):
        return bool(exc.retryable) or exc.status_code >= 500
    return isinstance(exc, httpx.TransportError)


def _service_error(what: str, base_url: str | None, exc: BaseException) -> BaseException:
    """A failure that retrying will not fix, with what the holder was doing and where."""
    from weaver import WeaverAPIError
    from weaver.operations import WeaverOperationError

    if isinstance(exc, (WeaverAPIError, WeaverOperationError)):
        return RuntimeError(f"the Weaver service at {base_url or 'the hosted default URL'} failed to {what}: {exc}")
    return exc


def _metrics_of(response: Any) -> dict[str, Any]:
    if not isinstance(response, dict):
        return {}
    metrics = response.get("metrics")
    if not isinstance(metrics, dict):
        metrics = (response.get("result") or {}).get("metrics") if isinstance(response.get("result"), dict) else None
    return {k: v for k, v in (metrics or {}).items() if isinstance(v, (int, float))}


def _tensor(values: Sequence[float] | Sequence[int], dtype: str) -> Any:
    from weaver.types import TensorData

    return TensorData(data=list(values), dtype=dtype)


def _to_weaver_datum(datum: RemoteDatum, loss_fn: str) -> Any:
    """A Weaver datum: cross-entropy reads weights; the RL losses read sampler logprobs and
    advantages, which are already zero wherever the loss mask is."""
    from weaver.types import Datum, ModelInput

    inputs = {"target_tokens": _tensor(datum.target_tokens, "int64")}
    if loss_fn == "cross_entropy":
        inputs["weights"] = _tensor(datum.loss_mask, "float32")
    else:
        inputs["logprobs"] = _tensor(datum.sampling_logprobs, "float32")
        inputs["advantages"] = _tensor(datum.advantages, "float32")
    return Datum(model_input=ModelInput.from_ints(list(datum.input_tokens)), loss_fn_inputs=inputs)


def _hosted_loss_config(config: TrainStepConfig) -> dict[str, float]:
    """What hosted Weaver takes of NexRL's loss options (`refused_options` has refused
    the rest): the entropy bonus."""
    return {key: float(value) for key, value in config.loss_fn_config.items() if key in HOSTED_OPTIONS}  # type: ignore[arg-type]
