"""nexrl-episodes: rollout scripts anywhere claim episodes over HTTP and talk to the policy through OpenAI.

``from nexrl_episodes import EpisodeClient`` is all a remote rollout script needs; the
server side (`nexrl_episodes.server`) is started by ``nexrl train`` when a recipe says
``rollout.source.name: episodes``. The client is imported on first use, so the plugin's
entry point stays cheap to load.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Episode", "EpisodeClient", "EpisodeEndedError", "EpisodeServerError", "NoEpisodeError"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from nexrl_episodes import client

        return getattr(client, name)
    raise AttributeError(f"module 'nexrl_episodes' has no attribute {name!r}")
