"""``open_self_hosted``: FSDP workers trained by a `SelfHostedTrainer`, sampled through a sampler process.

Opening the backend checks every recipe option the workers cannot honour (and refuses
it by key) before anything starts, then starts the sampler process (`SamplerProcess`:
an `Engine` of its own, so its compute and the rollouts' Python do not share this
process's GIL) and, while it loads, the workers' API server and ranks on 127.0.0.1
(`WorkerGroup`), or connects to a group started elsewhere
(``backend.options.workers_url``), and loads the model on every rank (with the recipe's
LoRA adapters, if any: the sampler then gets the merged weights). After each step
`sync_weights` gathers the policy on rank 0, which sends it straight to the sampler
process (``push_weights``: raw tensor frames, no pickle; a ``workers_url`` group's
frames are forwarded by this process instead); the sampler loads them in place and
acknowledges before the sync returns, so the next rollouts see the newest weights. Rollouts of
a later step may keep sampling while the workers train (``rollout.max_staleness``).
`close` stops the sampler process, destroys the group and stops the ranks' whole
session; the sampler and the ranks also end themselves when this process dies.

With the recipe's ``teacher.model`` (on-policy distillation) a second group, identifier
``teacher`` and ``backend.options.teacher_world_size`` ranks, loads the teacher on the
student's API server; its weights are never trained, and its only op in a run is
``compute_log_prob``, which scores each step's tokens before the advantages. Either
group lost is a lost run: both are stopped and started afresh (`restart`).

One key (`nexrl_fsdp.direct_zmq.group_key`) guards the run's group and its sampler: a
group started here gets a new one, which the sampler process (started first) holds too
so rank 0's pushes reach it, and every restarted group reuses it; a ``workers_url``
group's is the one its API server and ranks were given, from ``NEXRL_WORKER_KEY``,
without which the run is refused before anything starts.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from nexrl_core.chat.model import ChatModel
from nexrl_core.config.errors import ConfigError
from nexrl_core.config.lr_schedule import LearningRateSchedule, LRSchedule
from nexrl_core.training.backend import BackendSetup, BackendStartError
from nexrl_core.training.holders import TrainStepConfig
from nexrl_core.training.model_export import ModelExportError
from nexrl_core.training.placement import LOCAL_PLACEMENT, PlacementError, Placer, is_loopback, open_placer
from nexrl_core.training.self_hosted import SelfHostedTrainer, UpdateSettings
from nexrl_core.training.trainer import build_trainer
from nexrl_core.types import Trajectory
from nexrl_engine.batching import BatchedSamplingOptions
from nexrl_engine.config import EngineConfig
from nexrl_engine.loading import load_tokenizer, resolve_model_dir
from nexrl_engine.loss_fns import build_loss_fn
from nexrl_engine.recipe_checks import check_device, check_model_name, teacher_tokenizer_problem
from nexrl_fsdp.direct_zmq.api_server import WorkersApiServer
from nexrl_fsdp.direct_zmq.group_key import MissingGroupKey, key_from_env, new_group_key
from nexrl_fsdp.direct_zmq.launch import WorkerGroup
from nexrl_fsdp.direct_zmq.options import DirectZmqOptions
from nexrl_fsdp.direct_zmq.transport import DirectZmqTransport, OpRefused, WorkerGroupError
from nexrl_fsdp.selfhosted.config import SelfHostedBackendConfig
from nexrl_fsdp.selfhosted.sampler_chat import SamplerChat
from nexrl_fsdp.selfhosted.sampler_process import SamplerProcess
from nexrl_fsdp.selfhosted.sampler_server import SamplerSettings

__all__ = ["SelfHostedBackend", "open_self_hosted", "rank_threads", "refused_options", "sampler_threads"]

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
WORKERS_LOG = "workers.log"
TEACHER_LOG = "teacher.log"
TEACHER_IDENTIFIER = "teacher"
SAMPLER_LOG = "sampler.log"
WORKER_LOSS_INPUTS = frozenset({"old_logprobs", "advantages", "ref_logprobs", "entropy"})


def refused_options(train_step: TrainStepConfig) -> list[str]:
    """What the workers cannot honour of the trainer's step, as ``key: why`` lines (empty
    when everything runs). Everything else of the recipe reaches them, LoRA included."""
    try:
        loss = build_loss_fn(train_step.loss_fn, dict(train_step.loss_fn_config))
    except ValueError as error:
        return [f"algorithm.loss: {error}"]
    missing = sorted(loss.requires - WORKER_LOSS_INPUTS)
    if missing:
        return [f"algorithm.loss.name: loss {train_step.loss_fn!r} needs {', '.join(missing)}, which the workers do not compute"]
    return []


class SelfHostedBackend:
    """A worker group trained by a `SelfHostedTrainer`, and the sampler process rollouts use."""

    def __init__(
        self,
        trainer: SelfHostedTrainer,
        transport: DirectZmqTransport,
        chat: SamplerChat,
        *,
        work_dir: Path,
        group: WorkerGroup | None,
        teacher_group: WorkerGroup | None = None,
        placer: Placer | None,
        run_info: Mapping[str, str],
        setup: BackendSetup,
    ) -> None:
        self.setup = setup
        self.options: SelfHostedBackendConfig = setup.options
        self.restarts_left = self.options.max_restarts
        self._initial_trainer_state = trainer.state()
        self.trainer = trainer
        self.transport = transport
        self.chat = chat
        self.sampler = chat.process
        self.work_dir = work_dir
        self.group = group
        self.teacher_group = teacher_group
        self.placer = placer
        self._run_info = dict(run_info)
        self._version = 0
        self._closed = False

    def chat_model(self) -> ChatModel:
        return self.chat

    def run_info(self) -> Mapping[str, str]:
        """What the workers reported when they loaded the model."""
        return self._run_info

    def train(self, trajectories: Sequence[Trajectory], step: int) -> dict[str, float]:
        return self.trainer.train(trajectories, step)

    def sync_weights(self, step: int) -> str | None:
        """Load the workers' weights into the sampler process, if an update changed them."""
        if not self.trainer.trained_since_publish:
            return None
        return self.publish()

    def publish(self) -> str:
        """Gather the policy on rank 0 and load it into the sampler process in place; returns
        once the process has loaded it, so every sample asked for afterwards uses it.

        A group placed on this machine pushes the weights from rank 0 straight to the
        sampler (``push_weights``); the ranks of a ``workers_url`` group or of a placer
        that spans machines may run elsewhere, where the sampler's 127.0.0.1 is not
        reachable, so their weights come through here: the frames rank 0 sent, forwarded
        uncopied."""
        self.sampler.check_alive("load_weights")
        if self.group is not None and is_loopback(self.group.placer.control_host()):
            assert self.sampler.endpoint is not None
            self.transport.push_weights(self.sampler.endpoint)
        else:
            self.sampler.request({"kind": "load_weights"}, self.transport.get_weights())
        self.trainer.trained_since_publish = False
        self._version += 1
        return f"self-hosted://{self.transport.options.identifier}/weights/{self._version:06d}"

    def save_checkpoint(self, name: str) -> concurrent.futures.Future[str]:
        """Start saving the workers and the trainer's state in the background; returns a
        future of its directory, done once the checkpoint is complete. The next step's
        rollouts run meanwhile; its update waits for the save (one op at a time)."""
        if not name or name in (".", "..") or "/" in name or "\\" in name:
            raise ValueError(f"a checkpoint name must be a plain file name, got {name!r}")
        return self.trainer.save_checkpoint(self.work_dir / CHECKPOINT_DIR / name)

    def load_checkpoint(self, path: str) -> None:
        self.trainer.load_checkpoint(Path(path))
        self.publish()

    def restart(self) -> bool:
        """Stop the groups (the student's, and the teacher's when there is one, whichever
        was lost), start new ones (the student at the base weights, the teacher at its
        own) and give the student's weights to the sampler, started anew first if its
        process died (the loop then loads the last checkpoint into both, so the groups
        restart even when only the sampler was lost); False when ``max_restarts`` are
        spent or the group is not one this backend started (``workers_url``)."""
        if self.group is None or self.restarts_left <= 0:
            return False
        self.restarts_left -= 1
        if self.sampler.death() is not None:
            self.sampler = self.chat.process = self.sampler.respawn()
            self.sampler.wait_ready()
        for group in (self.group, self.teacher_group):
            if group is not None:
                logger.warning("the worker group %r's last output (%s):\n%s", group.identifier, group.log_path, group.log_tail(2000))
        _stop_groups(self.group, self.teacher_group)
        self.transport, self.group, self.teacher_group = _connect(self.setup, self.options, self.transport.options.key, self.placer)
        _init_workers(self.setup, self.trainer, self.transport, self.teacher_group)
        self.trainer.load_state(self._initial_trainer_state)
        self.publish()
        return True

    def lost(self) -> str | None:
        """The sampler process's death (`WatchedBackend`); a lost rank raises `WorkerGroupLost` itself."""
        return self.sampler.death()

    def export_model(self, directory: Path) -> Path:
        """The sampler's weights (the workers' policy as of the last sync) as an HF directory,
        written by the sampler process. A LoRA policy is written by rank 0 of the workers
        (where checkpoints go), which holds the adapter as well as the merged weights the
        sampler got: merged weights plus the adapter, as `Engine.export_hf` writes them.

        :raises ModelExportError: for LoRA, when the workers trained since the last sync
            (their policy is then not the one sampling uses).
        """
        target = str(Path(directory).resolve())
        if self.setup.recipe.model.lora.is_lora:
            if self.trainer.trained_since_publish:
                raise ModelExportError(
                    "self-hosted backend: the workers trained since the sampler's last sync, so their LoRA policy is not "
                    "the one sampling uses; call sync_weights before export_model"
                )
            return Path(self.transport.export_hf(target))
        reply = self.sampler.request({"kind": "export", "path": target})
        return Path(reply.header["path"])

    def close(self) -> None:
        """Let a running save finish, then stop the sampler, the workers and the API server.

        The sampler stops in a thread while the workers stop: each waits on processes
        that take a second or more to exit, and a signal's whole shutdown must fit in
        10 s on a slow machine."""
        if self._closed:
            return
        self._closed = True
        try:
            self.trainer.close()
        finally:
            stopping = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sampler-stop")
            sampler_stopped = stopping.submit(self.sampler.stop)
            try:
                if self.group is not None:
                    _stop_groups(self.group, self.teacher_group)
                else:
                    try:
                        self.transport.destroy()
                    finally:
                        self.transport.close()
            finally:
                stopping.shutdown()
                if self.placer is not None:
                    self.placer.close()
                sampler_stopped.result()


def _check(setup: BackendSetup, options: SelfHostedBackendConfig) -> SelfHostedTrainer:
    """Every refusal before anything starts; returns the configured trainer."""
    check_model_name(setup.recipe)
    check_device(options.sampler.device, "backend.options.sampler.device")
    schedule = LearningRateSchedule.from_recipe(setup.recipe)
    trainer = build_trainer(
        setup.recipe,
        options.trainer,
        "backend.options.trainer",
        through_transport=True,
        settings={
            "update": ("backend.options.update", options.update if options.update != UpdateSettings() else None),
            "recompute_old_logprobs": ("backend.options.recompute_old_logprobs", options.recompute_old_logprobs),
            "lr_schedule": (
                "algorithm.lr_schedule" if schedule.kind is not LRSchedule.CONSTANT else "algorithm.warmup_steps",
                None if schedule.is_constant else schedule,
            ),
        },
    )
    problems = refused_options(trainer.train_step)
    if options.workers_url is not None and (options.placement != LOCAL_PLACEMENT or options.placement_options):
        problems.append(
            "backend.options.placement: the group at backend.options.workers_url was started elsewhere, so nothing is "
            "placed; leave placement and placement_options unset, or workers_url null to place the ranks"
        )
    problems += _teacher_problems(setup, options)
    if setup.recipe.algorithm.kl.coef > 0 and not trainer.supports_kl:
        problems.append(f"algorithm.kl.coef: trainer {options.trainer!r} applies no KL penalty; set it to 0 or use self_hosted_grpo")
    if problems:
        trainer.close()
        raise ConfigError(problems)
    return trainer


def _teacher_problems(setup: BackendSetup, options: SelfHostedBackendConfig) -> list[str]:
    """What keeps the recipe's teacher off the workers, as ``key: why`` lines."""
    teacher = setup.recipe.teacher.model
    if teacher is None:
        if options.teacher_world_size is not None:
            return ["backend.options.teacher_world_size: the recipe sets no teacher.model; remove it or set teacher.model"]
        return []
    if options.workers_url is not None:
        return [
            "teacher.model: the group at backend.options.workers_url was started elsewhere, and a teacher's group is "
            "started with the run's; leave workers_url null to distil on self-hosted workers"
        ]
    try:
        scores_with = load_tokenizer(resolve_model_dir(teacher))
    except (OSError, ValueError) as error:
        return [f"teacher.model: cannot load {teacher!r}: {error}"]
    if scores_with.get_vocab() != load_tokenizer(resolve_model_dir(str(setup.recipe.model.name))).get_vocab():
        return [teacher_tokenizer_problem(teacher, str(setup.recipe.model.name))]
    return []


def _teacher_ranks(setup: BackendSetup, options: SelfHostedBackendConfig) -> int:
    """Ranks of the teacher's group: none without ``teacher.model``."""
    if setup.recipe.teacher.model is None:
        return 0
    return options.teacher_world_size if options.teacher_world_size is not None else options.world_size


def sampler_threads(options: SelfHostedBackendConfig) -> str:
    """The sampler process's ``OMP_NUM_THREADS``: the user's, else the cores this process
    may use less one per local worker rank and one for the driver's own Python (at
    least 1). More threads than free cores make every torch op of the sampler wait on
    a thread that is not running (see ``nexrl_engine/__init__.py``): on two cores beside
    two ranks, two sampler threads took the quickstart's rollouts from 0.10 to 0.25 s."""
    if os.environ.get("OMP_NUM_THREADS"):
        return os.environ["OMP_NUM_THREADS"]
    local_ranks = options.world_size if options.workers_url is None and options.placement == LOCAL_PLACEMENT else 0
    return str(max(1, len(os.sched_getaffinity(0)) - local_ranks - 1))


def rank_threads(options: SelfHostedBackendConfig) -> str:
    """Each local rank's ``OMP_NUM_THREADS``: the user's, else this process's cores shared
    out among the ranks. A step's phases take turns (the sampler rolls out, then the
    ranks train), so the ranks may use the cores the sampler uses: one thread for a lone
    rank on two cores made its train phase 3x slower than the in-process engine's."""
    if os.environ.get("OMP_NUM_THREADS"):
        return os.environ["OMP_NUM_THREADS"]
    return str(max(1, len(os.sched_getaffinity(0)) // options.world_size))


def start_group(
    options: SelfHostedBackendConfig,
    log_path: Path,
    placer: Placer,
    extra_env: dict[str, str] | None = None,
    key: str | None = None,
    server: WorkersApiServer | None = None,
) -> WorkerGroup:
    """The worker group ``options`` describe (no ``workers_url``), its ranks where
    ``placer`` puts them, with ``key`` (a new one when None), on ``server`` (an API
    server of its own when None)."""
    threads = rank_threads(options)
    return WorkerGroup(
        options.world_size,
        log_path,
        placer=placer,
        identifier=options.identifier,
        heartbeat_s=options.heartbeat_s,
        dead_after_s=options.dead_after_s,
        connect_timeout_s=options.connect_timeout_s,
        op_timeout_s=options.op_timeout_s,
        extra_env={"OMP_NUM_THREADS": threads, **(extra_env or {})},
        key=key,
        cpus_per_rank=float(threads),
        server=server,
    )


def _stop_groups(student: WorkerGroup | None, teacher: WorkerGroup | None) -> None:
    """The teacher's group first: it registered on the API server the student's group owns."""
    try:
        if teacher is not None:
            teacher.stop()
    finally:
        if student is not None:
            student.stop()


def _group_key(options: SelfHostedBackendConfig) -> str:
    """The run's key: a new one for a group started here, ``NEXRL_WORKER_KEY`` for a
    ``workers_url`` group.

    :raises BackendStartError: for a ``workers_url`` group without ``NEXRL_WORKER_KEY``.
    """
    if options.workers_url is None:
        return new_group_key()
    try:
        return key_from_env(f"backend.options.workers_url ({options.workers_url})")
    except MissingGroupKey as error:
        raise BackendStartError(str(error)) from None


def _connect(
    setup: BackendSetup, options: SelfHostedBackendConfig, key: str, placer: Placer | None
) -> tuple[DirectZmqTransport, WorkerGroup | None, WorkerGroup | None]:
    """The student's transport, its group (None for a ``workers_url`` group) and the
    teacher's group on the same API server (None without ``teacher.model``)."""
    if placer is not None:
        group = start_group(options, setup.work_dir / WORKERS_LOG, placer, key=key)
        teacher_ranks = _teacher_ranks(setup, options)
        if not teacher_ranks:
            return group.transport, group, None
        try:
            teacher_options = attrs.evolve(options, world_size=teacher_ranks, identifier=TEACHER_IDENTIFIER)
            teacher = start_group(teacher_options, setup.work_dir / TEACHER_LOG, placer, key=key, server=group.server)
        except BaseException:
            group.stop()
            raise
        return group.transport, group, teacher
    assert options.workers_url is not None, "a run without a placer joins the group at workers_url"
    transport = DirectZmqTransport(
        DirectZmqOptions(
            api_server_url=options.workers_url,
            key=key,
            identifier=options.identifier,
            world_size=options.world_size,
            connect_timeout_s=options.connect_timeout_s,
            op_timeout_s=options.op_timeout_s,
        )
    )
    try:
        transport.initialize_worker()
    except BaseException:
        transport.close()
        raise
    return transport, None, None


def _init_workers(
    setup: BackendSetup, trainer: SelfHostedTrainer, transport: DirectZmqTransport, teacher: WorkerGroup | None = None
) -> Mapping[str, Any]:
    """Load the recipe's model on the group's ranks (and its teacher, without adapters,
    on the teacher's) and bind the trainer to them."""
    engine = _engine_config(setup)
    info = transport.init_model(
        engine.model,
        dtype=engine.dtype,
        seed=setup.recipe.seed,
        lora=setup.recipe.model.lora,
        gradient_checkpointing=setup.recipe.model.gradient_checkpointing,
        mixed_precision=setup.recipe.model.mixed_precision,
    )
    if teacher is not None:
        assert setup.recipe.teacher.model is not None, "a teacher's group is started for the recipe's teacher"
        teacher.transport.init_model(setup.recipe.teacher.model, dtype=engine.dtype, seed=setup.recipe.seed)
    trainer.bind(
        transport,
        world_size=setup.options.world_size,
        pad_token_id=int(info["pad_token_id"]),
        teacher=None if teacher is None else teacher.transport,
        teacher_world_size=1 if teacher is None else teacher.nproc,
    )
    return info


def _engine_config(setup: BackendSetup) -> EngineConfig:
    """The recipe's model as the sampler's engine and the workers load it; with
    ``model.mixed_precision`` the sampler is a plain bfloat16 engine (the workers push it
    the bfloat16 weights their masters round to) and the workers get fp32 masters."""
    recipe = setup.recipe
    return EngineConfig(model=str(recipe.model.name), dtype=recipe.model.dtype.value, seed=recipe.seed, device=setup.options.sampler.device)


def open_self_hosted(setup: BackendSetup) -> SelfHostedBackend:
    """Open the ``self-hosted`` backend for one run.

    :raises ConfigError: naming the recipe key of anything the workers cannot honour,
        before any process starts.
    """
    options: SelfHostedBackendConfig = setup.options
    key = _group_key(options)
    trainer = _check(setup, options)
    try:
        placer = (
            None
            if options.workers_url is not None
            else open_placer(options.placement, options.placement_options, "backend.options.placement")
        )
    except BaseException:
        trainer.close()
        raise
    setup.work_dir.mkdir(parents=True, exist_ok=True)
    engine_config = _engine_config(setup)
    batching = BatchedSamplingOptions(
        sample_linger_s=options.sampler.sample_linger_s,
        sample_linger_max_s=options.sampler.sample_linger_max_s,
        max_batch_rows=options.sampler.max_batch_rows,
    )
    # Started first: it loads its model while the workers start.
    sampler = SamplerProcess(
        SamplerSettings(engine=engine_config, batching=batching),
        setup.work_dir / SAMPLER_LOG,
        key=key,
        extra_env={"OMP_NUM_THREADS": sampler_threads(options)},
    )
    group: WorkerGroup | None = None
    teacher: WorkerGroup | None = None
    transport: DirectZmqTransport | None = None
    try:
        try:
            transport, group, teacher = _connect(setup, options, key, placer)
            info = _init_workers(setup, trainer, transport, teacher)
        except OpRefused:
            raise
        except (WorkerGroupError, PlacementError) as error:
            raise BackendStartError(f"the self-hosted backend's worker group could not start: {error}") from None
        chat = SamplerChat(sampler, load_tokenizer(resolve_model_dir(engine_config.model)))
        sampler.wait_ready()
        run_info = {"dtype": str(info["dtype"]), "device": str(info["device"]), "world_size": str(info["world_size"])}
        if "master_dtype" in info:
            run_info["master_dtype"] = str(info["master_dtype"])
        backend = SelfHostedBackend(
            trainer,
            transport,
            chat,
            work_dir=setup.work_dir,
            group=group,
            teacher_group=teacher,
            placer=placer,
            run_info=run_info,
            setup=setup,
        )
        backend.publish()
        return backend
    except BaseException:
        sampler.stop()
        trainer.close()
        if group is not None:
            _stop_groups(group, teacher)
        elif transport is not None:
            transport.close()
        if placer is not None:
            placer.close()
        raise
