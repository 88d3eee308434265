"""A remote rollout script for NexRL's episode server: copy it to any machine and run it.

    pip install nexrl-episodes          # brings the openai client; no torch needed
    python addition_worker.py http://TRAINER:PORT --concurrency 32

or let NexRL run it for you: ``nexrl-episodes worker http://TRAINER:PORT addition_worker.py
--concurrency 32`` (it calls `rollout` below on every claimed episode), or list it in a
recipe's ``rollout.source.options.local_workers.script`` (the episodes quickstart does).

Each episode carries one task of the addition quickstart ({"a": 12, "b": 7}) and an
OpenAI client bound to it. The script asks the policy being trained, scores the answer
here (it could run tools, a sandbox, a search engine...), and reports the reward; the
server already recorded the tokens the model sampled.
"""

from __future__ import annotations

import argparse
import threading
from typing import Any

from nexrl_episodes import EpisodeClient, EpisodeEndedError

END_MARKERS = ("<|im_end|>", "<|endoftext|>")


def score(text: str, a: int, b: int) -> float:
    """1 for exactly the sum's digits (an end-of-turn marker after them is allowed), else 0."""
    answer = text.strip()
    while answer.endswith(END_MARKERS):
        for marker in END_MARKERS:
            answer = answer.removesuffix(marker).rstrip()
    return 1.0 if answer.isdigit() and answer == str(a + b) else 0.0


def rollout(episode: Any) -> float:
    """One episode: ask for ``a+b=``, return the reward."""
    a, b = int(episode.task["a"]), int(episode.task["b"])
    reply = episode.openai.chat.completions.create(model=episode.model, messages=[{"role": "user", "content": f"{a}+{b}="}])
    return score(reply.choices[0].message.content or "", a, b)


def work(client: EpisodeClient) -> None:
    while True:
        try:
            with client.episode() as episode:
                episode.end(rollout(episode))
        except EpisodeEndedError:
            continue  # our claim timed out and someone else runs it now; take the next one


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", help="the episode server, e.g. http://127.0.0.1:8765 (printed by nexrl train)")
    parser.add_argument("--concurrency", type=int, default=8, help="episodes in flight at once")
    args = parser.parse_args()
    with EpisodeClient(args.url) as client:
        threads = [threading.Thread(target=work, args=(client,), daemon=True) for _ in range(args.concurrency)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


if __name__ == "__main__":
    main()
