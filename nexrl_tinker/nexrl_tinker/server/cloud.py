"""`Cloud`: the one object that holds the service's state, shared by every route.

It wires the store, the futures book, the scheduler, the engine pool and the
checkpoint files together, checks ownership (every lookup of a session, model,
sampler or checkpoint takes the caller's owner id and answers 404 for an unknown id,
403 for another tenant's), and runs the housekeeping: at start-up it fails the
futures a killed process left pending and expires stale sessions; afterwards a
janitor thread repeats the expiry, deletes checkpoints past their TTL, prunes old
results and unblocks training queues stuck on a missing sequence number.
"""

from __future__ import annotations

import logging
import secrets
import shutil
import threading
import time
from pathlib import Path

from nexrl_tinker.server.engines import BaseModelInfo, EnginePool, TrainingSpec
from nexrl_tinker.server.errors import BadRequest, Forbidden, Gone, NotFound
from nexrl_tinker.server.futures import FutureBook
from nexrl_tinker.server.ids import SEGMENT_OF_KIND, safe_dirname
from nexrl_tinker.server.scheduler import Scheduler
from nexrl_tinker.server.settings import ServerSettings
from nexrl_tinker.server.store import (
    CheckpointRow,
    ModelRow,
    SamplerRow,
    SessionRow,
    Store,
)

__all__ = ["CheckpointFiles", "Cloud"]

log = logging.getLogger("nexrl_tinker.server")


class CheckpointFiles:
    """Where weights live under the data directory.

    ``runs/<model>/weights/<name>.<hex>/`` (training state), ``runs/<model>/
    sampler_weights/<name>.<hex>/`` (exported HF directories) and ``runs/<model>/
    ephemeral/<sampler>/`` (snapshots behind ``save_weights_and_get_sampling_client``).
    Every save writes a fresh directory, so an engine cached for an older directory
    can never serve overwritten weights.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)

    def model_dir(self, model_id: str) -> Path:
        return self.root / safe_dirname(model_id)

    def new_checkpoint_dir(self, model_id: str, kind: str, name: str) -> Path:
        return self.model_dir(model_id) / SEGMENT_OF_KIND[kind] / f"{safe_dirname(name)}.{secrets.token_hex(4)}"

    def ephemeral_dir(self, model_id: str, sampler_id: str) -> Path:
        return self.model_dir(model_id) / "ephemeral" / safe_dirname(sampler_id)

    def remove(self, directory: str | Path | None) -> None:
        if not directory:
            return
        path = Path(directory)
        try:
            path.resolve().relative_to(self.root.resolve())
        except ValueError:
            log.warning("not deleting %s: outside the data directory", path)
            return
        shutil.rmtree(path, ignore_errors=True)

    @staticmethod
    def size_of(directory: Path) -> int:
        return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def training_spec_of(model: ModelRow) -> TrainingSpec:
    return TrainingSpec(
        base_model=model.base_model,
        lora_rank=model.lora_rank,
        lora_seed=model.lora_seed,
        train_mlp=model.train_mlp,
        train_attn=model.train_attn,
        train_unembed=model.train_unembed,
    )


def warm_up_imports() -> None:
    """Import the engine stack once on the starting thread.

    transformers resolves its names lazily and that first resolution is not thread-safe:
    two engines built at once on cold imports can fail with ``cannot import name
    'AutoTokenizer'``. Importing here also takes the import time off the first request.
    """
    import nexrl_fsdp.engine
    import nexrl_fsdp.loss_fns  # noqa: F401
    import peft  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    from nexrl_core.registry import get_registry

    get_registry()


class Cloud:
    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        self.base = BaseModelInfo.load(settings.model)
        self.store = Store(settings.database_url)
        self.book = FutureBook(self.store)
        self.scheduler = Scheduler(
            self.book,
            settings.compute_threads,
            settings.gap_timeout_s,
            linger_s=settings.batch_linger_s,
            linger_max_s=settings.batch_linger_max_s,
        )
        self.engines = EnginePool(self.base, settings.sampler_cache_size)
        self.files = CheckpointFiles(settings.data_dir / "runs")
        self._stop = threading.Event()
        self._janitor: threading.Thread | None = None
        self.started_at = time.time()

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        warm_up_imports()
        orphaned = self.book.recover()
        if orphaned:
            log.warning("failed %d request(s) left in flight by a previous server process", orphaned)
        self.housekeeping()
        self._janitor = threading.Thread(target=self._janitor_loop, name="tinker-janitor", daemon=True)
        self._janitor.start()

    def close(self) -> None:
        self._stop.set()
        if self._janitor is not None:
            self._janitor.join(timeout=10)
            self._janitor = None
        self.scheduler.close()
        try:
            self.book.flush_fetched()
        except Exception:
            log.exception("could not record fetched results")
        self.engines.clear()
        self.store.close()

    def _janitor_loop(self) -> None:
        last_full = time.monotonic()
        while not self._stop.wait(1.0):
            try:
                self.scheduler.check_gaps()
                self.book.flush_fetched()
                if time.monotonic() - last_full >= self.settings.janitor_interval_s:
                    last_full = time.monotonic()
                    self.housekeeping()
            except Exception:
                log.exception("housekeeping failed")

    def housekeeping(self) -> None:
        now = time.time()
        for session in self.store.stale_sessions(now - self.settings.stale_session_s):
            self.expire_session(session)
        for checkpoint in self.store.expired_checkpoints(now):
            self.delete_checkpoint_files(checkpoint)
            self.store.delete_checkpoint(checkpoint.tinker_path)
        self.store.prune_futures(
            fetched_before=now - self.settings.fetched_retention_s,
            created_before=now - self.settings.unfetched_retention_s,
        )

    def expire_session(self, session: SessionRow) -> None:
        """Release what a stale session holds: engines, queues, ephemeral samplers.

        Named checkpoints stay (they have their own TTL and can be deleted explicitly),
        as do the training-run records, so saved tinker:// paths keep working.
        """
        log.info("expiring stale session %s", session.session_id)
        for model in self.store.models_of_session(session.session_id):
            self.engines.release_training(model.model_id)
            self.scheduler.drop(model.model_id)
        doomed = [s for s in self.store.samplers_of_session(session.session_id) if s.ephemeral]
        for sampler in doomed:
            if sampler.weights_dir:
                self.engines.forget_sampler(sampler.weights_dir)
                self.files.remove(sampler.weights_dir)
        self.store.delete_samplers([s.sampler_id for s in doomed])
        self.store.set_session_status(session.session_id, "expired")

    def delete_checkpoint_files(self, checkpoint: CheckpointRow) -> None:
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

    def own_checkpoint(self, owner: str, tinker_path: str) -> CheckpointRow:
        checkpoint = self.store.get_checkpoint(tinker_path)
        if checkpoint is None:
            raise NotFound(f"unknown checkpoint {tinker_path!r}")
        if checkpoint.owner != owner:
            raise Forbidden(f"checkpoint {tinker_path!r} belongs to another session (a different API key)")
        if not Path(checkpoint.storage_dir).is_dir():
            raise Gone(f"checkpoint {tinker_path!r} has no files any more (deleted on disk)")
        return checkpoint

    def check_base_model(self, base_model: str) -> str:
        served = {self.base.name, str(self.base.directory)}
        if base_model not in served:
            raise BadRequest(f"unknown base model {base_model!r}; this server serves {self.base.name!r}")
        return self.base.name
