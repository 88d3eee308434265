"""Which `nexrl_engine.Engine` serves which model or sampler, built lazily.

* One engine per training model (full fine-tuning or LoRA, as its creation
  asked). It is built on first use: when the model is created, or after a restart from
  the model's last saved state. With worker groups (``--workers N``) a training model's
  "engine" is a group engine instead (`nexrl_core.training.worker_groups`, from whichever installed
  plugin provides them): the same calls, run by its own group of N ranks. At most
  ``max_groups`` run at once: a create beyond that is refused (`TooManyRequests`, naming
  the limit), and releasing a model stops its group; once groups keep failing to start
  the same way, no more are started (`group_starts`).
* Sampling engines are keyed by the weights they serve (the base model, an exported
  HF directory, or a training-state directory on top of the base), so every sampler
  of the same weights shares one engine. The least recently used is dropped when
  more than ``sampler_cache_size`` are loaded.

Engines are only touched on compute threads; building one takes a per-key lock so
two requests never load the same weights twice.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from nexrl_core.http.serving import DEFAULT_MAX_TOKENS_PER_MICROBATCH
from nexrl_core.training.placement import PlacementUnavailable
from nexrl_core.training.worker_groups import GroupEngines, GroupEngineSetup, GroupHooks, GroupSettings
from nexrl_engine.config import EngineConfig, TrainingSpec
from nexrl_service.errors import RequestFailed, TooManyRequests
from nexrl_service.group_starts import GroupStarts

__all__ = ["BaseModelInfo", "EnginePool", "GroupLimits", "ModelReleased", "WeightsRef"]

log = logging.getLogger("nexrl_service")


def _new_engine(*args: Any, **kwargs: Any) -> Any:
    # `Engine` serialises model loading itself (transformers' from_pretrained is not
    # thread-safe), so compute threads may build engines for different weights at once.
    from nexrl_engine.engine import Engine

    return Engine(*args, **kwargs)


class ModelReleased(RequestFailed):
    """A model's engine was released while it was being built; nothing of it is kept."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "user")


@attrs.frozen
class BaseModelInfo:
    """The served base model, read once from its directory (no torch needed)."""

    name: str
    """What clients call it (``base_model``, ``model_name``): ``--model-name``, else the
    shipped model's own Hugging Face-style name (`nexrl_engine.loading.SHIPPED_HUB_NAMES`),
    else the ``--model`` path as given."""
    source: str
    """What engines load and what the store records a model was created from: the
    ``--model`` value as given (a shipped name resolves on every machine a worker group
    runs on, where an absolute path of this machine might not)."""
    directory: Path
    tokenizer_id: str
    """The name ``get_info`` gives clients to fetch the tokenizer by (`nexrl_service.hub`);
    a served path for a directory that has no Hugging Face-style name."""
    arch: str | None
    vocab_size: int
    max_context_length: int | None

    @classmethod
    def load(cls, model: str, model_name: str | None = None) -> BaseModelInfo:
        from nexrl_engine.loading import SHIPPED_HUB_NAMES, resolve_model_dir

        directory = resolve_model_dir(model)
        config = json.loads((directory / "config.json").read_text())
        shipped = SHIPPED_HUB_NAMES.get(model)
        name = model_name or (shipped.model_name if shipped else model)
        return cls(
            name=name,
            source=model,
            directory=directory,
            tokenizer_id=shipped.tokenizer_id if shipped else name,
            arch=config.get("model_type"),
            vocab_size=int(config["vocab_size"]),
            max_context_length=config.get("max_position_embeddings"),
        )

    def sampling_model(self, model: str) -> BaseModelInfo:
        """``model`` served beside this one for sampling and scoring only
        (`nexrl_core.http.serving.ServeOptions.sampling_models`).

        :raises ValueError: naming ``model``, for one that is not there or whose vocabulary
            is not this one's (its log-probs of this model's token ids would mean nothing).
        """
        try:
            other = BaseModelInfo.load(model)
        except (ValueError, OSError, KeyError) as exc:
            raise ValueError(f"{model!r}: {exc}") from None
        if other.vocab_size != self.vocab_size:
            raise ValueError(
                f"{model!r} has a vocabulary of {other.vocab_size} tokens and the served model {self.name!r} one of "
                f"{self.vocab_size}: a model sampled or scored beside it must share its tokenizer"
            )
        return other

    @property
    def aliases(self) -> frozenset[str]:
        """Every name a request may give for this model: the served name, the ``--model``
        value and its directory (what clients before served names sent)."""
        return frozenset({self.name, self.source, str(self.directory)})


@attrs.frozen(kw_only=True)
class GroupLimits:
    """Training models on worker groups (`nexrl_core.training.worker_groups`)."""

    engines: GroupEngines
    """The installed plugin's, which starts each model's group."""
    settings: GroupSettings
    """Ranks per group, threads per rank, where logs go, the placer."""
    max_groups: int
    """Most groups running at once."""
    gpus: int = 0
    """GPUs of this machine that groups take, one per rank and each for one group only
    (0 on a machine without CUDA: ranks run on the CPU)."""


@attrs.frozen
class WeightsRef:
    """What a sampling engine serves."""

    kind: str
    """``base``, ``hf`` (exported directory) or ``state`` (training state on the base)."""
    directory: str | None = None
    training: TrainingSpec | None = None
    """For ``state``: the model the state was saved from."""

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.directory or ''}"


class EnginePool:
    """The loaded engines: one per training model, and an LRU of sampling engines."""

    def __init__(
        self,
        base: BaseModelInfo,
        sampler_cache_size: int,
        dtype: str = "fp32",
        groups: GroupLimits | None = None,
        *,
        device: str = "cpu",
        max_tokens_per_microbatch: int = DEFAULT_MAX_TOKENS_PER_MICROBATCH,
    ) -> None:
        self.base = base
        self.dtype = dtype
        """Precision of every engine built here."""
        self.device = device
        """Where every engine built here lives (``cpu``, ``cuda``, ``cuda:N``); a worker
        group's ranks pick their own devices."""
        self.max_tokens_per_microbatch = max_tokens_per_microbatch
        """Most padded tokens per forward or forward/backward pass of every engine built
        here, a worker group's included (its ranks pack their passes by it)."""
        self.groups = groups
        """Worker groups for training models; None trains them in this process."""
        self.group_starts = GroupStarts()
        """Groups that failed to start, so one that keeps failing is not started again."""
        self._sampler_cache_size = max(1, sampler_cache_size)
        self._lock = threading.Lock()
        self._training: dict[str, Any] = {}
        self._samplers: OrderedDict[str, Any] = OrderedDict()
        self._build_locks: dict[str, threading.Lock] = {}
        self._group_slots: set[str] = set()
        """Models holding one of the ``max_groups`` places (their group runs or starts)."""
        self._gpus_of: dict[str, list[int]] = {}
        """The GPUs each model's group holds, on a machine with GPUs."""
        self._stopping: list[threading.Thread] = []
        self._releases: dict[str, int] = {}
        """How often each model was released: a build that sees this change was overtaken."""

    def _build_lock(self, key: str) -> threading.Lock:
        with self._lock:
            return self._build_locks.setdefault(key, threading.Lock())

    # --- training engines -------------------------------------------------------------------

    def training(self, model_id: str) -> Any | None:
        with self._lock:
            return self._training.get(model_id)

    def training_or_build(self, model_id: str, build: Callable[[], Any]) -> Any:
        """The model's engine, building it with ``build()`` the first time.

        :raises ModelReleased: when the model was released while it was being built (its
            session ended meanwhile); the new engine is dropped, a new group stopped.
        """
        engine = self.training(model_id)
        if engine is not None:
            return engine
        with self._build_lock(f"train:{model_id}"):
            engine = self.training(model_id)
            if engine is None:
                with self._lock:
                    releases = self._releases.get(model_id, 0)
                engine = build()
                with self._lock:
                    released = self._releases.get(model_id, 0) != releases
                    if not released:
                        self._training[model_id] = engine
                if released:
                    if self.groups is not None:
                        engine.stop()
                    raise ModelReleased(f"model {model_id!r} was released (its session ended) while it was being loaded")
            return engine

    def new_training_engine(self, model_id: str, spec: TrainingSpec, hooks: GroupHooks | None = None) -> Any:
        """An `Engine` for the model, or with worker groups a group engine (which takes
        one of the places `reserve_group` hands out, and tells ``hooks`` about its restart
        points and restarts)."""
        if self.groups is None:
            return _new_engine(self._config(spec))
        refusal = self.group_starts.refusal()
        if refusal is not None:
            raise RequestFailed(refusal, "server")
        self.reserve_group(model_id)
        try:
            engine = self.groups.engines.start(
                GroupEngineSetup(
                    model_id=model_id,
                    training=spec,
                    dtype=self.dtype,
                    settings=self.groups.settings,
                    base_sampler=lambda: self.sampler(WeightsRef("base")),
                    hooks=hooks if hooks is not None else GroupHooks(),
                    gpus=self.gpus_of(model_id),
                    max_tokens_per_microbatch=self.max_tokens_per_microbatch,
                )
            )
        except BaseException as exc:
            with self._lock:
                self._group_slots.discard(model_id)
                self._gpus_of.pop(model_id, None)
            if isinstance(exc, PlacementUnavailable):  # a full cluster, not a broken start: ask again later
                raise TooManyRequests(str(exc)) from None
            if isinstance(exc, Exception):
                self.group_starts.failed(exc)
            raise
        self.group_starts.succeeded()
        return engine

    def reserve_group(self, model_id: str) -> None:
        """Hold a worker-group place for the model (kept until `release_training`); a
        no-op without worker groups or when the model holds one already.

        On a machine with GPUs the model also takes a GPU of its own for each rank.

        :raises TooManyRequests: when ``max_groups`` places are taken, or too few GPUs are
            free for another group, naming the limit.
        """
        if self.groups is None:
            return
        with self._lock:
            if model_id in self._group_slots:
                return
            limit = self.groups.max_groups
            if len(self._group_slots) >= limit:
                raise TooManyRequests(
                    f"this service runs at most {limit} worker group{'s' if limit != 1 else ''} at once "
                    f"(--max-worker-groups {limit}) and all are in use by other models; finish a session "
                    "or terminate a model first, or start the service with a higher --max-worker-groups"
                )
            gpus = self._free_gpus()
            if len(gpus) < self.groups.settings.ranks:
                taken = len(self._gpus_of)
                raise TooManyRequests(
                    f"a worker group of {self.groups.settings.ranks} rank{'s' if self.groups.settings.ranks != 1 else ''} needs "
                    f"as many GPUs of its own, and {len(gpus)} of this machine's {self.groups.gpus} are free "
                    f"({taken} model{'s' if taken != 1 else ''} hold the others); finish a session or terminate a model first, "
                    "or start the service with fewer --workers"
                )
            self._group_slots.add(model_id)
            if self.groups.gpus:
                self._gpus_of[model_id] = gpus[: self.groups.settings.ranks]

    def _free_gpus(self) -> list[int]:
        assert self.groups is not None
        taken = {gpu for owned in self._gpus_of.values() for gpu in owned}
        return [gpu for gpu in range(self.groups.gpus) if gpu not in taken] if self.groups.gpus else list(range(self.groups.settings.ranks))

    def gpus_of(self, model_id: str) -> list[int]:
        """The GPUs a model's group runs on (none on a CPU machine)."""
        with self._lock:
            return list(self._gpus_of.get(model_id, []))

    def release_training(self, model_id: str) -> bool:
        """Forget the model's engine; a worker group is stopped (in the background, once
        its call in flight is done) and its place freed."""
        with self._lock:
            engine = self._training.pop(model_id, None)
            self._releases[model_id] = self._releases.get(model_id, 0) + 1
            self._group_slots.discard(model_id)
            self._gpus_of.pop(model_id, None)
            if self.groups is not None and engine is not None:
                thread = threading.Thread(target=engine.stop, name=f"stop-group-{model_id}", daemon=True)
                self._stopping = [t for t in self._stopping if t.is_alive()] + [thread]
                thread.start()
        return engine is not None

    def training_sampler(self, model_id: str) -> Any | None:
        """A sampling engine on a worker-group model's current weights, fed from its
        group; None for a model trained in this process (its state is loaded instead)."""
        engine = self.training(model_id)
        return engine.sampler() if self.groups is not None and engine is not None else None

    # --- sampling engines -------------------------------------------------------------------

    def sampler(self, ref: WeightsRef) -> Any:
        key = ref.key
        with self._lock:
            engine = self._samplers.get(key)
            if engine is not None:
                self._samplers.move_to_end(key)
                return engine
        with self._build_lock(f"sample:{key}"):
            with self._lock:
                engine = self._samplers.get(key)
            if engine is None:
                engine = self._build_sampler(ref)
                with self._lock:
                    self._samplers[key] = engine
                    self._evict_samplers()
            return engine

    def adopt_sampler(self, ref: WeightsRef, engine: Any) -> None:
        """Cache an engine built elsewhere (the weights a training engine just exported)
        as the sampler of ``ref``, so the first request does not load it from disk."""
        with self._lock:
            self._samplers[ref.key] = engine
            self._samplers.move_to_end(ref.key)
            self._evict_samplers()

    def _evict_samplers(self) -> None:
        while len(self._samplers) > self._sampler_cache_size:
            evicted, _ = self._samplers.popitem(last=False)
            log.info("dropped sampling engine %s from memory", evicted)

    def _config(self, spec: TrainingSpec) -> EngineConfig:
        """A training model's engine config, in this pool's precision, device and micro-batch budget."""
        return spec.engine_config(self.dtype, self.device, self.max_tokens_per_microbatch)

    def _build_sampler(self, ref: WeightsRef) -> Any:
        if ref.kind == "base":
            return _new_engine(
                model=self.base.source, dtype=self.dtype, device=self.device, max_tokens_per_microbatch=self.max_tokens_per_microbatch
            )
        if ref.kind == "hf":
            assert ref.directory is not None
            return _new_engine(
                model=ref.directory, dtype=self.dtype, device=self.device, max_tokens_per_microbatch=self.max_tokens_per_microbatch
            )
        if ref.kind == "state":
            assert ref.directory is not None and ref.training is not None
            engine = _new_engine(self._config(ref.training))
            engine.load_state(ref.directory, load_optimizer=False)
            return engine
        raise ValueError(f"unknown weights kind {ref.kind!r}")

    def loaded(self) -> list[Any]:
        """Every engine loaded now: the training models' (`Engine` or group engine) and
        the cached samplers."""
        with self._lock:
            return [*self._training.values(), *self._samplers.values()]

    def forget_sampler(self, directory: str) -> None:
        """Drop cached engines serving ``directory`` (its files are being deleted)."""
        with self._lock:
            for key in [k for k in self._samplers if k.endswith(f":{directory}")]:
                del self._samplers[key]

    def clear(self) -> None:
        """Drop every engine; stop every worker group and wait until they have ended."""
        with self._lock:
            engines = list(self._training.values())
            self._training.clear()
            self._samplers.clear()
            self._group_slots.clear()
            stopping, self._stopping = self._stopping, []
        if self.groups is not None:
            for engine in engines:
                engine.stop()
        for thread in stopping:
            thread.join()
