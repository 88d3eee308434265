"""``nexrl-episodes worker URL SCRIPT --concurrency N``: run a rollout function on claimed episodes.

SCRIPT is a ``.py`` file or ``package.module:function``; a file's function is
``rollout`` unless named (``script.py:solve``). The function takes an `Episode` and
returns the reward (a number, or a mapping with ``reward`` and numeric metrics); the
worker claims, calls it and ends the episode, N episodes in flight on N threads. A
function that raises gives its episode back to the queue and the worker goes on.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from nexrl_episodes.client import Episode, EpisodeClient, EpisodeEndedError, EpisodeServerError

log = logging.getLogger("nexrl.episodes.worker")

RolloutFunction = Callable[[Episode], Any]

_STOP_GRACE_S = 5.0
"""How long a stopping worker lets running episodes finish before it exits."""


def load_function(script: str) -> RolloutFunction:
    """The rollout function ``script`` names (see the module docstring)."""
    target, name = script.rsplit(":", 1) if ":" in script and not Path(script).exists() else (script, "")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise SystemExit(f"rollout script {str(path)!r} does not exist")
        spec = importlib.util.spec_from_file_location(f"nexrl_episode_script_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        name = name or "rollout"
    else:
        if not name:
            raise SystemExit(f"{script!r}: name a .py file or package.module:function")
        module = importlib.import_module(target)
    function = getattr(module, name, None)
    if not callable(function):
        raise SystemExit(f"{script!r} has no function {name!r} (it must take an Episode and return the reward)")
    return function


def _reward_of(outcome: Any) -> tuple[float, dict[str, Any]]:
    if isinstance(outcome, Mapping):
        if "reward" not in outcome:
            raise ValueError(f"the rollout function returned a mapping without 'reward' (keys: {', '.join(map(str, outcome))})")
        return outcome["reward"], {key: value for key, value in outcome.items() if key != "reward"}
    return outcome, {}


def run_episodes(client: EpisodeClient, function: RolloutFunction, stop: threading.Event) -> None:
    """One worker thread: claim, run, end, until ``stop`` is set."""
    while not stop.is_set():
        try:
            episode = client.claim(timeout_s=2.0)
        except (TimeoutError, ConnectionError, EpisodeServerError) as error:
            if not isinstance(error, TimeoutError):
                log.warning("cannot claim: %s", error)
                stop.wait(1.0)
            continue
        try:
            reward, metadata = _reward_of(function(episode))
            episode.end(reward, **metadata)
        except EpisodeEndedError as error:
            log.warning("episode %s was taken back: %s", episode.episode_id, error.message)
        except Exception as error:  # noqa: BLE001 - the script's failure gives its episode back
            log.exception("rollout of episode %s failed; giving it back", episode.episode_id)
            try:
                episode.abort(f"{type(error).__name__}: {error}")
            except (EpisodeServerError, ConnectionError):
                pass


def _watch_parent(parent: int, stop: threading.Event) -> None:
    while not stop.wait(0.5):
        if os.getppid() != parent:
            stop.set()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="nexrl-episodes", description="Run rollout scripts against a NexRL episode server.")
    commands = parser.add_subparsers(dest="command", required=True)
    worker = commands.add_parser("worker", help="claim episodes and run a rollout function on them")
    worker.add_argument("url", help="the episode server's base URL, e.g. http://127.0.0.1:8765")
    worker.add_argument("script", help="a .py file (function 'rollout', or file.py:function) or package.module:function")
    worker.add_argument("--concurrency", type=int, default=1, help="episodes in flight at once (threads)")
    worker.add_argument("--api-key", default=os.environ.get("NEXRL_EPISODES_API_KEY"), help="the server's key, if it has one")
    worker.add_argument("--exit-with-parent", action="store_true", help="stop when the process that started this one ends")
    args = parser.parse_args(argv)
    if args.concurrency < 1:
        parser.error(f"--concurrency must be at least 1, got {args.concurrency}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    function = load_function(args.script)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if args.exit_with_parent:
        threading.Thread(target=_watch_parent, args=(os.getppid(), stop), daemon=True).start()
    with EpisodeClient(args.url, api_key=args.api_key) as client:
        threads = [
            threading.Thread(target=run_episodes, args=(client, function, stop), name=f"episode-worker-{index}", daemon=True)
            for index in range(args.concurrency)
        ]
        for thread in threads:
            thread.start()
        try:
            while not stop.wait(0.2) and any(thread.is_alive() for thread in threads):
                pass
        except KeyboardInterrupt:
            stop.set()
        # Episodes still running are abandoned: the server requeues them after its claim timeout.
        deadline = time.monotonic() + _STOP_GRACE_S
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
    sys.exit(0)


if __name__ == "__main__":
    main()
