"""`ServiceState`: the one object that holds a local service's state, shared by every route.

It wires the store, the futures book, the scheduler, the engine pool, the checkpoint
files, their signed downloads and the janitor together, and checks ownership: every lookup of a session,
model, sampler or checkpoint takes the caller's owner id and answers 404 for an
unknown id, 403 for another tenant's, so a tenant stays inside its own resources
whatever protocol it speaks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from nexrl_core.http.serving import ServiceStartError
from nexrl_service.downloads import SignedDownloads
from nexrl_service.engines import BaseModelInfo, EnginePool, GroupLimits, WeightsRef
from nexrl_service.errors import BadRequest, Forbidden, Gone, NotFound
from nexrl_service.files import CheckpointFiles
from nexrl_service.futures import FutureBook
from nexrl_service.hub import HubRepo, hub_name_problem, seed_cache
from nexrl_service.janitor import Janitor
from nexrl_service.scheduler import Scheduler
from nexrl_service.settings import ServerSettings
from nexrl_service.store import CheckpointRow, ModelRow, SamplerRow, SessionRow, Store

__all__ = ["ServiceState", "warm_up_imports"]

log = logging.getLogger("nexrl_service")

WORKERS_EXTRA = "nexrl-service[workers]"
"""What brings worker groups (``--workers N``) to a service installed without them."""


def warm_up_imports() -> None:
    """Import the engine stack once on the starting thread.

    transformers resolves its names lazily and that first resolution is not thread-safe:
    two engines built at once on cold imports can fail with ``cannot import name
    'AutoTokenizer'``. Importing here also takes the import time off the first request.
    """
    import nexrl_engine.engine
    import nexrl_engine.loss_fns  # noqa: F401

    # isort: split
    import peft  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    from nexrl_core.plugins.registry import get_registry

    get_registry()


def _group_limits(settings: ServerSettings) -> GroupLimits | None:
    """Worker groups for training models when ``settings.workers`` asks for them, from the
    installed plugin that provides them, each rank with an equal share of this process's
    torch threads, placed by the placer ``settings.placement`` names. Both are opened here,
    so a service without them, or a cluster that is not there, stops at start.

    :raises ServiceStartError: naming ``--workers`` (and the extra that brings worker
        groups) or ``--placement``, and why it cannot be used.
    """
    if settings.workers == 0:
        return None
    import torch

    from nexrl_core.config.errors import ConfigError
    from nexrl_core.plugins.registry import RegistryError
    from nexrl_core.training.placement import LOCAL_PLACEMENT, PlacementError, is_loopback, open_placer
    from nexrl_core.training.worker_groups import GroupSettings, NoGroupEngines, open_group_engines

    try:
        engines = open_group_engines()
    except NoGroupEngines as error:
        reason = f"{error}; pip install '{WORKERS_EXTRA}' brings them"
        message = f"--workers {settings.workers} trains each model on a worker group, but {reason}"
        raise ServiceStartError(message, option="workers", reason=reason) from None
    except RegistryError as error:
        raise ServiceStartError(f"--workers {settings.workers}: {error}", option="workers", reason=str(error)) from None

    name = settings.placement or LOCAL_PLACEMENT
    try:
        placer = open_placer(name, settings.placement_options, "placement")
    except ConfigError as error:  # problems named as the command line spells them
        problems = [
            problem.replace("placement.name: ", "").replace("placement.options.", "--placement-option ") for problem in error.problems
        ]
        raise ServiceStartError(f"--placement {name}: {'; '.join(problems)}", option="placement") from None
    except PlacementError as error:
        raise ServiceStartError(f"--placement {name}: {error}", option="placement") from None

    group = GroupSettings(
        ranks=settings.workers,
        threads_per_rank=max(1, torch.get_num_threads() // settings.workers),
        log_dir=settings.data_dir / "workers",
        heartbeat_s=settings.worker_heartbeat_s,
        dead_after_s=settings.worker_dead_after_s,
        op_timeout_s=settings.worker_op_timeout_s,
        save_every=settings.worker_save_every,
        max_restarts=settings.worker_max_restarts,
        placer=placer,
    )
    # GPUs of this machine are handed out here only to ranks placed on it; a cluster's placer hands out its own.
    gpus = engines.local_gpus() if is_loopback(placer.control_host()) else 0
    return GroupLimits(engines=engines, settings=group, max_groups=settings.max_worker_groups, gpus=gpus)


def _sampling_models(base: BaseModelInfo, models: Sequence[str]) -> tuple[BaseModelInfo, ...]:
    """``--sampling-model``'s models beside ``base`` (`BaseModelInfo.sampling_model`).

    :raises ServiceStartError: naming the flag and the model at fault.
    """
    try:
        return tuple(base.sampling_model(model) for model in models)
    except ValueError as exc:
        raise ServiceStartError(f"--sampling-model {exc}", option="sampling_models", reason=str(exc)) from None


class ServiceState:
    """Store, futures, scheduler, engines, files and janitor of one running service."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        self.base = BaseModelInfo.load(settings.model, settings.model_name)
        self.sampling_models = _sampling_models(self.base, settings.sampling_models)
        """Served for sampling and scoring only (``--sampling-model``)."""
        self.store = Store(settings.database_url)
        self.book = FutureBook(self.store)
        self.scheduler = Scheduler(
            self.book,
            settings.compute_threads,
            settings.gap_timeout_s,
            linger_s=settings.batch_linger_s,
            linger_max_s=settings.batch_linger_max_s,
            thread_name=f"{settings.name}-compute",
        )
        self.engines = EnginePool(
            self.base,
            settings.sampler_cache_size,
            settings.dtype,
            _group_limits(settings),
            device=settings.device,
            max_tokens_per_microbatch=settings.max_tokens_per_microbatch,
        )
        self.files = CheckpointFiles(settings.data_dir / "runs")
        self.downloads = SignedDownloads(self.files.root, settings.download_url_ttl_s)
        self.hub = HubRepo.of((self.base.name, self.base.tokenizer_id), self.base.directory)
        self.janitor = Janitor(self)
        self.started_at = time.time()

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Load the engine stack, recover from a previous process, start the janitor, and
        make the tokenizer loadable by name on this machine (`nexrl_service.hub`)."""
        warm_up_imports()
        if hub_name_problem(self.base.name) is not None:
            log.warning(
                "serving %s under its path: tinker-cookbook's lookups and clients on other machines need a Hugging "
                "Face-style name, given with --model-name Org/Name",
                self.base.name,
            )
        if self.base.tokenizer_id in self.hub.names:
            seed_cache(self.hub, self.base.tokenizer_id)
        self.janitor.start()

    def close(self) -> None:
        self.janitor.stop()
        self.scheduler.close()
        try:
            self.book.flush_fetched()
        except Exception:
            log.exception("could not record fetched results")
        self.engines.clear()
        if self.engines.groups is not None:
            self.engines.groups.settings.placer.close()
        self.store.close()

    def release_model(self, model_id: str) -> None:
        """Let a model go for good (its session ended, it was terminated): stop its engine
        or group and delete the restart points its group saved."""
        self.engines.release_training(model_id)
        self.files.remove(self.files.autosave_dir(model_id))

    def forget_checkpoint_files(self, checkpoint: CheckpointRow) -> None:
        """Delete a checkpoint's files and any sampling engine cached for them."""
        self.engines.forget_sampler(checkpoint.storage_dir)
        self.files.remove(checkpoint.storage_dir)

    # --- ownership ------------------------------------------------------------------------------

    def own_session(self, owner: str, session_id: str, *, active: bool = False) -> SessionRow:
        if not isinstance(session_id, str) or not session_id:
            raise BadRequest("session_id must be a non-empty string")
        session = self.store.get_session(session_id)
        if session is None:
            raise NotFound(f"unknown session {session_id!r}")
        if session.owner != owner:
            raise Forbidden(f"session {session_id!r} belongs to another API key")
        if active and session.status == "expired":
            raise Gone(f"session {session_id!r} expired after {self.settings.stale_session_s / 3600:g} h without a heartbeat")
        return session

    def own_model(self, owner: str, model_id: str) -> ModelRow:
        if not isinstance(model_id, str) or not model_id:
            raise BadRequest("model_id must be a non-empty string")
        model = self.store.get_model(model_id)
        if model is None:
            raise NotFound(f"unknown model {model_id!r}")
        if model.owner != owner:
            raise Forbidden(f"model {model_id!r} belongs to another session (a different API key)")
        return model

    def own_sampler(self, owner: str, sampler_id: str) -> SamplerRow:
        if not isinstance(sampler_id, str) or not sampler_id:
            raise BadRequest("sampling_session_id must be a non-empty string")
        sampler = self.store.get_sampler(sampler_id)
        if sampler is None:
            raise NotFound(f"unknown sampling session {sampler_id!r} (it may have expired)")
        if sampler.owner != owner:
            raise Forbidden(f"sampling session {sampler_id!r} belongs to another session (a different API key)")
        return sampler

    def own_checkpoint(self, owner: str, path: str, *, public_ok: bool = False) -> CheckpointRow:
        """The caller's checkpoint ``path``; with ``public_ok``, also another key's published
        one (reading it: sampling, loading, copying; never changing it).

        A checkpoint past its ``expires_at`` is unknown from that moment, as on hosted
        Tinker, though the janitor deletes its files only on its next sweep.
        """
        checkpoint = self.store.get_checkpoint(path)
        if checkpoint is None:
            raise NotFound(f"unknown checkpoint {path!r}")
        if checkpoint.owner != owner and not (public_ok and checkpoint.public):
            unpublished = " and is not published" if public_ok else ""
            raise Forbidden(f"checkpoint {path!r} belongs to another session (a different API key){unpublished}")
        if checkpoint.expires_at is not None and checkpoint.expires_at <= time.time():
            expired = datetime.fromtimestamp(checkpoint.expires_at, tz=timezone.utc).isoformat()
            raise NotFound(f"checkpoint {path!r} expired at {expired} (its time-to-live ran out) and is deleted")
        if not Path(checkpoint.storage_dir).is_dir():
            raise Gone(f"checkpoint {path!r} has no files any more (deleted on disk)")
        return checkpoint

    def sampling_base(self, base_model: str) -> tuple[str, WeightsRef]:
        """What the store records and the weights a sampler of ``base_model`` serves: the
        served model (`check_base_model`) or one of the ``--sampling-model`` models
        (`BaseModelInfo.aliases`), else `BadRequest` naming all of them."""
        for model in self.sampling_models:
            if base_model in model.aliases:
                return model.source, WeightsRef("hf", str(model.directory))
        if base_model in self.base.aliases:
            return self.base.source, WeightsRef("base")
        served = ", ".join(repr(name) for name in (self.base.name, *(model.name for model in self.sampling_models)))
        raise BadRequest(f"unknown base model {base_model!r}; this server samples {served}")

    def served_name(self, source: str) -> str:
        """The name clients know the model a store row records as ``source`` by."""
        return next((model.name for model in self.sampling_models if model.source == source), self.base.name)

    def check_base_model(self, base_model: str) -> str:
        """What the store records for the served base model (its ``--model`` value) if
        ``base_model`` names it (`BaseModelInfo.aliases`), else `BadRequest`. Rows keep that
        value, not the served name, so a service restarted under another ``--model-name``
        still owns what it made; answers report `BaseModelInfo.name`."""
        if base_model not in self.base.aliases:
            if any(base_model in model.aliases for model in self.sampling_models):
                raise BadRequest(
                    f"{base_model!r} is served for sampling and scoring only (--sampling-model); the trained model is {self.base.name!r}"
                )
            raise BadRequest(f"unknown base model {base_model!r}; this server serves {self.base.name!r}")
        return self.base.source
