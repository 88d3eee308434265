"""The ``episodes`` rollout source: each run request becomes an episode that a client claims over HTTP.

`EpisodeSource.open` starts the episode server for the run (and, when the recipe asks,
local worker processes), `submit` queues a step's requests as episodes and returns the
futures their ``end_episode`` calls resolve, and `close` fails whatever still waits and
stops everything it started. The store lives in ``<output.dir>/rollout/`` by default, so
``nexrl train --resume`` after a crash reuses every episode that had already ended.

Weight versions: with ``rollout.max_staleness`` s, the loop submits step k once the
weights after step k-1-s are published, so that is the version episodes of step k are
sampled with; `EpisodeBook.can_continue` compares it with the newest version.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from nexrl_core.config.converter import dump_config
from nexrl_core.config.errors import ConfigError
from nexrl_core.config.schema import TrainConfig
from nexrl_core.run.limits import TurnLimits
from nexrl_core.run.llm_client import SamplingDefaults
from nexrl_core.run.rollout import PendingBatch, RunRequest
from nexrl_core.training.backend import RolloutSetup
from nexrl_episodes.book import EpisodeBook
from nexrl_episodes.plugin import EpisodesOptions, recipe_problems
from nexrl_episodes.server import EpisodeServer
from nexrl_episodes.store import EpisodeStore, default_url

log = logging.getLogger("nexrl.episodes")

SERVER_FILE = "episode_server.json"
"""Written to the rollout directory: where clients reach this run's server."""
WORKER_LOG = "workers.log"
_WORKER_STOP_TIMEOUT_S = 10.0


def open_book(store: EpisodeStore, options: EpisodesOptions, recipe: TrainConfig) -> EpisodeBook:
    """A run's episode book: claims expire and episodes fail as the source's options say;
    staleness, the prompt and response limits and the model name clients use come from
    the recipe."""
    return EpisodeBook(
        store,
        claim_timeout_s=options.claim_timeout_s,
        max_attempts=options.max_attempts,
        max_staleness=recipe.rollout.max_staleness,
        model=recipe.model.name or "nexrl-policy",
        limits=TurnLimits.of(recipe.rollout),
    )


class EpisodeSource:
    """A `RolloutSource` whose runs are episodes claimed by clients anywhere."""

    def __init__(self, book: EpisodeBook, server: EpisodeServer, defaults: SamplingDefaults, max_staleness: int) -> None:
        self.book = book
        self.server = server
        self.defaults = defaults
        self.max_staleness = max_staleness
        self.workers: list[subprocess.Popen[bytes]] = []
        self._worker_log: IO[bytes] | None = None

    @classmethod
    def open(cls, setup: RolloutSetup) -> EpisodeSource:
        options: EpisodesOptions = setup.options
        recipe = setup.recipe
        problems = recipe_problems(recipe, options)  # nexrl train asked already; a direct open has not
        if problems:
            raise ConfigError(problems)
        try:
            store = EpisodeStore(options.db_url or default_url(setup.work_dir))
        except ValueError as error:
            raise ConfigError([str(error)]) from None
        dropped = store.drop_unfinished()
        if dropped:
            log.info("%d episode(s) of an earlier server had not ended; they run again when their step comes", dropped)
        book = open_book(store, options, recipe)
        defaults = SamplingDefaults(
            max_tokens=recipe.rollout.max_tokens, temperature=recipe.rollout.temperature, top_p=recipe.rollout.top_p
        )
        train_config = {
            "model": book.model,
            "sampling": {"max_tokens": defaults.max_tokens, "temperature": defaults.temperature, "top_p": defaults.top_p},
            "max_staleness": recipe.rollout.max_staleness,
            "claim_timeout_s": options.claim_timeout_s,
            "recipe": dump_config(recipe),
        }
        server = EpisodeServer(
            book,
            setup.model,
            host=options.host,
            port=options.port,
            public_url=options.public_url,
            api_key=options.api_key,
            train_config=train_config,
        )
        try:
            base_url = server.start()
        except BaseException:
            store.close()
            raise
        source = cls(book, server, defaults, recipe.rollout.max_staleness)
        try:
            (Path(setup.work_dir) / SERVER_FILE).write_text(json.dumps({"base_url": options.public_url or base_url}))
            source._start_workers(options, base_url, Path(setup.work_dir))
        except BaseException:
            source.close()
            raise
        print(f"episode server: {options.public_url or base_url} (rollout clients claim episodes there)", flush=True)
        return source

    def _start_workers(self, options: EpisodesOptions, base_url: str, work_dir: Path) -> None:
        workers = options.local_workers
        if not workers.processes:
            return
        assert workers.script is not None
        self._worker_log = open(work_dir / WORKER_LOG, "ab")  # noqa: SIM115 - closed by close()
        env = dict(os.environ)
        if options.api_key:
            env["NEXRL_EPISODES_API_KEY"] = options.api_key
        command = [
            sys.executable,
            "-m",
            "nexrl_episodes.worker",
            "worker",
            base_url,
            workers.script,
            "--concurrency",
            str(workers.concurrency),
            "--exit-with-parent",
        ]
        for _ in range(workers.processes):
            self.workers.append(
                subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=self._worker_log, stderr=subprocess.STDOUT, env=env)
            )

    def submit(self, step: int, requests: Sequence[RunRequest], temperature: float | None = None) -> PendingBatch:
        """Queue every request as an episode; ``temperature`` replaces the recipe's (validation)."""
        if requests and not requests[0].is_val:
            self.book.set_policy_version(max(self.book.policy_version, step - 1 - self.max_staleness))
        defaults = (
            self.defaults
            if temperature is None
            else SamplingDefaults(max_tokens=self.defaults.max_tokens, temperature=temperature, top_p=self.defaults.top_p)
        )
        return PendingBatch(step, self.book.register(requests, defaults))

    def close(self) -> None:
        """Fail the runs still waiting, stop the workers and the server, close the store."""
        self.book.close()
        for process in self.workers:
            if process.poll() is None:
                process.terminate()
        for process in self.workers:
            try:
                process.wait(timeout=_WORKER_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.workers = []
        if self._worker_log is not None:
            self._worker_log.close()
            self._worker_log = None
        self.server.stop()
        self.book.store.close()

    def stats(self) -> dict[str, Any]:
        return self.book.store.counts()
