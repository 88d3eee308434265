"""`TinkerServiceHolder`: sampling and training through the real ``tinker`` SDK.

The same holder talks to Thinking Machines' hosted Tinker (``base_url`` and
``TINKER_API_KEY``) and to NexRL's local Tinker-compatible service; nothing here knows
which. One instance serves the rollout workers and the trainer, so sampling always uses
the weights the trainer last published.
"""

from __future__ import annotations

import functools
import logging
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nexrl_core.chat.model import SamplingOptions
from nexrl_core.training.holders import LossOptionValue, TrainStepConfig
from nexrl_core.training.model_export import ModelExportError
from nexrl_core.types import RemoteDatum
from nexrl_remote_api.retries import RetriesExhausted
from nexrl_remote_api.sdk_holder import SampledSequence, SdkServiceHolder
from nexrl_tinker.holder_config import TinkerHolderConfig

if TYPE_CHECKING:
    from tinker.types import TensorDtype

logger = logging.getLogger(__name__)

RL_LOSSES = frozenset({"importance_sampling", "ppo", "cispo", "gspo", "dro"})
"""Losses that read the sampler's logprobs and per-token advantages."""
HOSTED_LOSSES = frozenset({"cross_entropy", "importance_sampling", "ppo", "cispo"})
"""The losses hosted Tinker computes itself (NexRL's local service has every registered one)."""
CLIPPED_LOSSES = frozenset({"ppo", "cispo"})
"""Tinker losses that take ``clip_low_threshold`` / ``clip_high_threshold`` (ratio bounds)."""
DOWNLOAD_TIMEOUT_S = 300.0
"""Per file of an exported model, for the signed-URL downloads."""


def _transient_errors() -> tuple[type[BaseException], ...]:
    import tinker

    return (tinker.APIConnectionError, tinker.APITimeoutError, tinker.InternalServerError, tinker.RateLimitError)


class TinkerServiceHolder(SdkServiceHolder[TinkerHolderConfig]):
    """A `nexrl_core.training.holders.ServiceHolder` on the ``tinker`` SDK (the skeleton:
    `SdkServiceHolder`). Chats render with the tinker-cookbook renderer ``renderer_name``
    names or, with it unset, the one the cookbook recommends for the model (as NexRL v1
    did); a model the cookbook does not know renders with the tokenizer's chat template."""

    api = "Tinker"
    hosted_losses = HOSTED_LOSSES

    def __init__(self, config: TinkerHolderConfig, sampling_path: str | None = None) -> None:
        self._renderer: Any = None
        self._teacher: Any = None
        super().__init__(config, sampling_path)

    # --- connection ----------------------------------------------------------------------------

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
                    lambda: (
                        self._service_client()
                        .create_lora_training_client(
                            self.config.model.name,
                            rank=lora.rank,
                            seed=self.config.seed,
                            train_mlp=lora.train_mlp,
                            train_attn=lora.train_attn,
                            train_unembed=lora.train_unembed,
                        )
                        .result()
                    ),
                )
            return self._training

    def _sampling_client_of(self, path: str) -> Any:
        return self._service_client().create_sampling_client(model_path=path).result()

    def _new_reference_client(self) -> Any:
        return self._service_client().create_sampling_client(base_model=self.config.model.name).result()

    def _close_service(self, service: Any) -> None:
        service.close("success").result()

    def _auth_headers(self) -> dict[str, str]:
        return {"X-API-Key": self.config.api_key} if self.config.api_key else {}

    def _service_tokenizer(self) -> Any:
        """The tokenizer ``get_info`` names, from this machine's Hugging Face cache when it
        is there, else as the SDK loads it.

        NexRL's local service puts its model's tokenizer into the cache under that name
        when it starts (`nexrl_service.hub.seed_cache`), a name the Hub itself does not
        have. The SDK's own load asks the Hub first: offline, each of its lookups retries
        for about 20 s before falling back to the cache (2.5 minutes before a run's first
        sample), and online the Hub does not know the name."""
        from transformers import AutoTokenizer

        training = self._training_client()
        name = training.get_info().model_data.tokenizer_id
        if name:
            try:
                return AutoTokenizer.from_pretrained(name, local_files_only=True)
            except (OSError, ValueError):  # not cached here (a hosted model), or it needs the SDK's own options
                pass
        return training.get_tokenizer()

    def _tokenizer_loaded(self, tokenizer: Any) -> None:
        name = self.config.renderer_name or _recommended_renderer(self.config.model.name)
        if name:
            self._renderer = _cookbook_renderer(name, tokenizer)

    def _chat_renderer(self) -> Any:
        """The tinker-cookbook renderer (``renderer_name``'s or the model's recommended one), or
        None for the tokenizer's template."""
        self.tokenizer()
        return self._renderer

    def _is_transient(self, error: BaseException) -> bool:
        return isinstance(error, _transient_errors())

    # --- sampling ------------------------------------------------------------------------------

    def _send_sample(self, prompt: list[int], options: SamplingOptions, num_samples: int) -> list[SampledSequence]:
        import tinker

        params = tinker.types.SamplingParams(**self._sampling_fields(options))
        model_input = tinker.types.ModelInput.from_ints(tokens=prompt)
        response = self._retry(
            "sample",
            lambda: self._sampling_client().sample(model_input, num_samples=num_samples, sampling_params=params).result(),
        )
        return [
            SampledSequence(
                tokens=[int(token) for token in sequence.tokens],
                logprobs=[float(value) for value in sequence.logprobs or []],
                stop_reason=sequence.stop_reason,
            )
            for sequence in response.sequences
        ]

    # --- training ------------------------------------------------------------------------------

    def _datum(self, datum: RemoteDatum, loss_fn: str) -> Any:
        return _to_tinker_datum(datum, loss_fn)

    def _hosted_loss_config(self, config: TrainStepConfig) -> dict[str, float]:
        return _hosted_loss_config(config)

    def _train_step(self, training: Any, data: list[Any], config: TrainStepConfig, loss_fn_config: dict[str, Any]) -> dict[str, float]:
        import tinker

        adam = tinker.types.AdamParams(**config.optimizer.to_json())
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
                f"{self._where()} failed to {what} after the tinker SDK's own retries: {type(error).__name__}: {error}; "
                "the holder does not send it again, since the service may have applied it already"
            ) from error

    def _hosted_option_refusal(self, loss_fn: str, option: str, value: LossOptionValue) -> str | None:
        if option in ("clip_low", "clip_high") and loss_fn in CLIPPED_LOSSES:
            return None
        if option == "entropy_coeff":
            return None if value == 0 else "hosted Tinker's losses have no entropy bonus; set it to 0"
        return self._no_such_option(loss_fn)

    def reference_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Logprobs under the base model, from a sampling client of the base weights
        (``compute_logprobs``), as tinker-cookbook computes its KL reference."""
        return _scored(self._reference_client(), sequences)

    def teacher_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Logprobs under the recipe's teacher (`nexrl_core.training.holders.TeacherHolder`), from a
        sampling client of its base model (``compute_logprobs``), as tinker-cookbook's
        on-policy distillation scores the student's tokens. Hosted Tinker samples any
        model it lists; NexRL's service the ones it was started with ``--sampling-model``."""
        if self.config.teacher is None:
            raise RuntimeError("this holder was built without a teacher (teacher.model)")
        teacher = self.config.teacher
        with self._lock:
            if self._teacher is None:
                self._teacher = self._retry(
                    "create the teacher's sampling client",
                    lambda: self._service_client().create_sampling_client(base_model=teacher).result(),
                )
            client = self._teacher
        return _scored(client, sequences)

    def close(self) -> None:
        with self._lock:
            self._teacher = None
        super().close()

    def update_sampling_weights(self, weight_path: str | None = None) -> str:
        with self._lock:
            if weight_path is None:
                name = self._next_sampler_name()
                training = self._training_client()
                weight_path = self._retry("save sampler weights", lambda: training.save_weights_for_sampler(name).result().path)
                self._samples_trained_weights = True
            else:
                self._samples_trained_weights = False
            assert weight_path is not None
            self._sampling = self._sampling_client_of(weight_path)
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

    # --- export: Tinker's external weights -----------------------------------------------------

    def _export_weights(self, training: Any) -> str:
        """The training client saves its weights as external weights (``save_weights_external``)."""
        name = f"nexrl_export_{secrets.token_hex(4)}"
        return str(self._retry("export the weights", lambda: training.save_weights_external(name).result().path))

    def _download_export(self, export: str, directory: Path) -> str:
        """The REST client signs one URL per file (``get_external_weights_urls``), each file
        is fetched with a plain GET, and the export is deleted from the service again."""
        import tinker

        rest = tinker.RestClient(base_url=self.config.base_url, api_key=self.config.api_key)
        try:
            signed = self._retry("sign download URLs", lambda: rest.get_external_weights_urls(export).result())
            _download_files(signed.urls, directory, export)
        finally:
            try:
                rest.delete_checkpoint_from_tinker_path(export).result()
            except Exception as exc:  # the download is what matters; the export expires with its service
                logger.warning("could not delete the temporary export %s from the service: %s", export, exc)
        return f"the service's export {export} (files: {', '.join(sorted(signed.urls))})"


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


def _tensor(values: Sequence[float] | Sequence[int], dtype: TensorDtype) -> Any:
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


@functools.cache
def _recommended_renderer(model: str | None) -> str | None:
    """The renderer tinker-cookbook recommends for ``model``; None, said once per model in
    the run's log (hence the cache), when the cookbook does not know the model or is not
    installed: the tokenizer's chat template then renders chats, and its prompts and stop
    tokens may differ from what the recommended renderer would give."""
    try:
        from tinker_cookbook import model_info
    except ImportError:
        logger.warning(
            "renderer_name unset and tinker-cookbook is not installed to recommend one: chats use the tokenizer's chat "
            "template (pip install --no-deps tinker-cookbook, or set backend.options.holder.renderer_name)"
        )
        return None
    try:
        return model_info.get_recommended_renderer_name(str(model))
    except (KeyError, ValueError):
        logger.warning(
            "renderer_name unset and tinker-cookbook recommends no renderer for %s: chats use the tokenizer's chat template "
            "(set backend.options.holder.renderer_name to choose one)",
            model,
        )
        return None


def _cookbook_renderer(name: str, tokenizer: Any) -> Any:
    try:
        from tinker_cookbook import renderers
    except ImportError as exc:
        raise ValueError(f"renderer_name {name!r} needs tinker-cookbook: pip install --no-deps tinker-cookbook (see the README)") from exc
    return renderers.get_renderer(name, tokenizer)


def _scored(client: Any, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
    """Each sequence's ``log p(token[i] | tokens[:i])`` under ``client``'s weights, 0.0 at
    position 0 (``SamplingClient.compute_logprobs``, every sequence in flight at once)."""
    import tinker

    futures = [client.compute_logprobs(tinker.types.ModelInput.from_ints(tokens=list(tokens))) for tokens in sequences]
    return [[0.0 if value is None else float(value) for value in future.result()] for future in futures]
