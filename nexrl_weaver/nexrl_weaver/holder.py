"""`WeaverServiceHolder`: sampling and training through the real ``nex-weaver`` SDK.

The same holder talks to hosted Weaver (``WEAVER_BASE_URL`` / ``WEAVER_API_KEY``) and
to NexRL's local Weaver-compatible service; nothing here knows which, except for the
losses and options it may send (`WeaverServiceHolder.refused_options`). One instance
serves the rollout workers and the trainer, so sampling always uses the weights the
trainer last published. Chat templates, default stops and tool-call parsing are
`nexrl_core.chat.holder.TemplateChat`, shared with every other holder.

The SDK waits for an operation without a deadline and polls with a back-off that
grows to 10 s; the holder submits with ``wait=False`` and waits itself (`_wait`):
quick polls, and a clear error after ``operation_timeout_s``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from nexrl_core.chat.model import SamplingOptions
from nexrl_core.training.holders import LossOptionValue, TrainStepConfig
from nexrl_core.training.model_export import ModelExportError
from nexrl_core.types import RemoteDatum
from nexrl_remote_api.sdk_holder import SampledSequence, SdkServiceHolder
from nexrl_weaver.holder_config import WeaverHolderConfig

HOSTED_LOSSES = frozenset({"cross_entropy", "importance_sampling"})
"""The losses hosted Weaver computes (NexRL's local service has every registered one)."""
HOSTED_OPTIONS = frozenset({"entropy_coeff"})
"""Loss options hosted Weaver takes (NexRL's own Weaver holder sends this one)."""
EXPORT_TTL_S = 3600
"""How long the service keeps an export: the holder downloads it at once, and the Weaver
API has no call to delete one."""
HEARTBEAT_S = 1.0
"""The session heartbeat's period. The SDK's ``close`` waits for its heartbeat thread,
which sleeps a whole period between beats, for up to 5 s: at its default period (30 s)
every run's close took 5 s; at 1 s it takes at most one."""
API_KEY_ENV = "WEAVER_API_KEY"
BASE_URL_ENV = "WEAVER_BASE_URL"


class WeaverServiceHolder(SdkServiceHolder[WeaverHolderConfig]):
    """A `nexrl_core.training.holders.ServiceHolder` on the ``nex-weaver`` SDK (the skeleton:
    `SdkServiceHolder`), which waits for each operation itself (`_wait`)."""

    api = "Weaver"
    default_url_name = "the hosted default URL"
    hosted_losses = HOSTED_LOSSES

    # --- connection ----------------------------------------------------------------------------

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
                    base_url=self.base_url,
                    api_key=api_key,
                    tensor_transport=self.config.tensor_transport,
                    heartbeat_interval=HEARTBEAT_S,
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
                self._training = self._retry("create a model", lambda: service.create_model(base_model=model.name, **options))
            return self._training

    def _sampling_client_of(self, path: str) -> Any:
        return self._retry(
            "create a sampling client",
            lambda: self._service_client().create_sampling_client(model_path=path, base_model=self.config.model.name),
        )

    def _new_reference_client(self) -> Any:
        return self._service_client().create_sampling_client(base_model=self.config.model.name)

    def _close_service(self, service: Any) -> None:
        service.close()

    def _auth_headers(self) -> dict[str, str]:
        api_key = self.config.api_key or os.environ.get(API_KEY_ENV)
        return {"X-WEAVER-API-KEY": api_key} if api_key else {}

    def _is_transient(self, error: BaseException) -> bool:
        return _is_transient(error)

    def _failure(self, what: str, error: BaseException) -> BaseException | None:
        from weaver import WeaverAPIError
        from weaver.operations import WeaverOperationError

        if isinstance(error, (WeaverAPIError, WeaverOperationError)):
            return RuntimeError(f"{self._where()} failed to {what}: {error}")
        return None

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

    # --- sampling ------------------------------------------------------------------------------

    def _send_sample(self, prompt: list[int], options: SamplingOptions, num_samples: int) -> list[SampledSequence]:
        from weaver.types import ModelInput, SamplingParams

        params = SamplingParams(**self._sampling_fields(options))
        model_input = ModelInput.from_ints(prompt)
        response = self._wait(
            "sample",
            lambda: self._sampling_client().sample(prompt=model_input, sampling_params=params, num_samples=num_samples, wait=False),
        )
        sequences = (response or {}).get("result", {}).get("sequences") or (response or {}).get("sequences")
        if not isinstance(sequences, list) or len(sequences) != num_samples:
            raise RuntimeError(f"Weaver returned {len(sequences or [])} sequences for {num_samples} samples: {response!r:.300}")
        return [
            SampledSequence(
                tokens=[int(token) for token in sequence.get("tokens") or []],
                logprobs=[float(value) for value in sequence.get("logprobs") or []],
                stop_reason=sequence.get("stop_reason"),
            )
            for sequence in sequences
        ]

    # --- training ------------------------------------------------------------------------------

    def _datum(self, datum: RemoteDatum, loss_fn: str) -> Any:
        return _to_weaver_datum(datum, loss_fn)

    def _hosted_loss_config(self, config: TrainStepConfig) -> dict[str, float]:
        return _hosted_loss_config(config)

    def _train_step(self, training: Any, data: list[Any], config: TrainStepConfig, loss_fn_config: dict[str, Any]) -> dict[str, float]:
        from weaver._payloads import prepare_forward_backward_operation
        from weaver.tensor_transport import PreparedOperationBody
        from weaver.types import AdamParams

        adam = AdamParams(**config.optimizer.to_json())
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

    def _hosted_option_refusal(self, loss_fn: str, option: str, value: LossOptionValue) -> str | None:
        return None if option in HOSTED_OPTIONS else self._no_such_option(loss_fn)

    def reference_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Logprobs under the base model, from a sampling session of the base weights
        (``compute_logprobs``)."""
        reference = self._reference_client()
        return [self._reference_logprobs(reference, tokens) for tokens in sequences]

    def _reference_logprobs(self, reference: Any, tokens: Sequence[int]) -> list[float]:
        """One sequence's: a call of its own, so the retried lambda holds these tokens (no loop variable to bind)."""
        from weaver.types import ModelInput

        values = self._retry("compute reference logprobs", lambda: reference.compute_logprobs(prompt=ModelInput.from_ints(list(tokens))))
        return [0.0 if value is None else float(value) for value in values]

    def update_sampling_weights(self, weight_path: str | None = None) -> str:
        with self._lock:
            trains_here = weight_path is None
            if weight_path is None:
                name = self._next_sampler_name()
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

    # --- export: Weaver's weights artifacts ----------------------------------------------------

    def _export_weights(self, training: Any) -> Any:
        """The training client exports its current weights (``export_weights``, LoRA merged
        into the base with ``merge_adapter``, which the local service writes with the
        adapter beside it under ``adapter/``)."""
        merge = self.config.model.lora.is_lora
        return self._wait(
            "export the weights",
            lambda: training.export_weights(merge_adapter=merge, ttl_seconds=EXPORT_TTL_S, wait=False),
        )

    def _download_export(self, export: Any, directory: Path) -> str:
        """The service client fetches every file of the artifact over its presigned URLs
        (``download_weights``, which checks each file's sha256)."""
        from weaver.types import WeightsArtifact

        artifact = export if isinstance(export, WeightsArtifact) else WeightsArtifact.from_payload(export or {})
        if artifact.kind != "hf_model" or artifact.status not in (None, "completed"):
            raise ModelExportError(
                f"the Weaver service exported a {artifact.kind!r} artifact with status {artifact.status!r} "
                f"(error: {artifact.error}); a model export needs a completed 'hf_model'"
            )
        service = self._service_client()
        self._retry("download the exported weights", lambda: service.download_weights(artifact, directory))
        return f"the Weaver service's artifact {artifact.id}"


def _is_transient(exc: BaseException) -> bool:
    import httpx
    from weaver import WeaverAPIError

    if isinstance(exc, WeaverAPIError):
        return bool(exc.retryable) or exc.status_code >= 500
    return isinstance(exc, httpx.TransportError)


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
    return {key: float(value) for key, value in config.loss_fn_config.items() if key in HOSTED_OPTIONS}
