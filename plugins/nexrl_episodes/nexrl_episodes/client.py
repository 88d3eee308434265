"""`EpisodeClient`: what a rollout script on any machine uses to take part in training.

    client = EpisodeClient("http://trainer:8765")
    with client.episode() as episode:
        reply = episode.openai.chat.completions.create(model=episode.model, messages=[...])
        episode.end(reward=score(reply))

`claim` waits until an episode is available; ``episode.openai`` is an ``openai.OpenAI``
client bound to that episode (its ``api_key`` is the episode's key, valid until the
episode ends). Connection errors are retried with exponential backoff, which is safe:
``end_episode`` is idempotent, and a claim whose answer was lost goes back to the
queue on its own after the server's claim timeout.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import httpx

log = logging.getLogger("nexrl.episodes.client")

CLAIM_WAIT_S = 10.0
"""How long one claim request waits on the server for an episode to come (long polling)."""


class EpisodeServerError(RuntimeError):
    """The server refused a request; ``status`` is its HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"episode server answered {status}: {message}")
        self.status = status
        self.message = message


class EpisodeEndedError(EpisodeServerError):
    """The episode's claim no longer holds (it ended, or went back to the queue after a
    timeout or an abort): drop it and claim another."""


class NoEpisodeError(TimeoutError):
    """No episode became available within the time `EpisodeClient.claim` was given."""


@attrs.define(kw_only=True, eq=False)
class Episode:
    """A claimed episode: the task, and an OpenAI client for the policy bound to it."""

    episode_id: str
    task: dict[str, Any]
    """The task item the training run registered (e.g. ``{"a": 12, "b": 7}``)."""
    task_id: str
    is_val: bool
    base_url: str
    """OpenAI base URL (``.../v1``) for this episode's model calls."""
    api_key: str
    """This episode's key: works for its model calls only, until it ends."""
    model: str
    """The name to pass as ``model=`` (the server serves one policy)."""
    client: EpisodeClient = attrs.field(repr=False)
    ended: bool = False
    """True once `end` was acknowledged."""
    _openai: Any = attrs.field(default=None, repr=False)

    @property
    def openai(self) -> Any:
        """An ``openai.OpenAI`` client for this episode (created on first use)."""
        if self._openai is None:
            import openai

            self._openai = openai.OpenAI(
                base_url=self.base_url,
                api_key=self.api_key,
                http_client=self.client.http,  # type: ignore[arg-type]  # openai's annotation names only httpx2.Client; it takes an httpx.Client too
                max_retries=2,
            )
        return self._openai

    def end(self, reward: float, **metadata: Any) -> bool:
        """Report the reward (numeric ``metadata`` values become metrics); True for a repeat."""
        duplicate = self.client.end(self, reward, metadata)
        self.ended = True
        return duplicate

    def abort(self, reason: str = "") -> None:
        """Give the episode back to the queue (another client will run it)."""
        self.client.abort(self, reason)

    def can_continue(self) -> bool:
        """False once the claim was lost or the policy moved past the run's allowed staleness."""
        return self.client.can_continue(self)


class EpisodeClient:
    """Claims episodes from one episode server and reports their rewards."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        client_id: str | None = None,
        timeout_s: float = 600.0,
        retries: int = 8,
        backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
    ) -> None:
        """
        :param api_key: the server's own key, when it was started with one (claims need it).
        :param timeout_s: per-request timeout; a model call may take long on a busy trainer.
        :param retries: attempts after a connection error before giving up.
        """
        self.base_url = base_url.rstrip("/")
        self.client_id = client_id or f"client-{uuid.uuid4().hex[:12]}"
        self.http = httpx.Client(timeout=timeout_s, limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
        self._api_key = api_key
        self._retries = retries
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> EpisodeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _post(self, path: str, body: Mapping[str, Any] | None, key: str | None) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return self._request("POST", path, body or {}, headers)

    def _request(self, method: str, path: str, body: Mapping[str, Any] | None, headers: dict[str, str]) -> dict[str, Any]:
        delay = self._backoff_s
        for attempt in range(self._retries + 1):
            try:
                response = self.http.request(method, f"{self.base_url}{path}", json=body, headers=headers)
            except httpx.TransportError as error:
                if attempt == self._retries:
                    raise ConnectionError(f"episode server {self.base_url} unreachable ({error}) after {attempt + 1} tries") from error
                log.info("episode server unreachable (%s); retrying in %.1f s", error, delay)
                time.sleep(delay)
                delay = min(delay * 2, self._max_backoff_s)
                continue
            if response.status_code >= 400:
                try:
                    message = response.json()["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = response.text
                error_class = EpisodeEndedError if response.status_code == 409 else EpisodeServerError
                raise error_class(response.status_code, message)
            return response.json()
        raise AssertionError("unreachable")

    def claim(self, timeout_s: float | None = None) -> Episode:
        """Claim the next episode, waiting for one (the server holds the request until one
        comes, so waiting costs no polling); `NoEpisodeError` after ``timeout_s``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait = CLAIM_WAIT_S if deadline is None else max(0.0, min(CLAIM_WAIT_S, deadline - time.monotonic()))
            answer = self._post("/claim_episode", {"client_id": self.client_id, "wait_s": wait}, self._api_key)
            if answer.get("episode_id"):
                return Episode(
                    episode_id=answer["episode_id"],
                    task=answer["task"],
                    task_id=answer["task_id"],
                    is_val=answer["is_val"],
                    base_url=answer["base_url"],
                    api_key=answer["api_key"],
                    model=answer["model"],
                    client=self,
                )
            if deadline is not None and time.monotonic() >= deadline:
                raise NoEpisodeError(f"no episode to claim within {timeout_s:g} s (engine {answer.get('engine_status')})")
            if answer.get("engine_status") == "offline":
                time.sleep(float(answer.get("retry_after_s", 1.0)))

    def end(self, episode: Episode, reward: float, metadata: Mapping[str, Any] | None = None) -> bool:
        """Report ``reward``; True when the server already had this episode's end (a repeat)."""
        body = {"episode_id": episode.episode_id, "reward": reward, "metadata": dict(metadata or {})}
        return bool(self._post("/end_episode", body, episode.api_key)["duplicate"])

    def abort(self, episode: Episode, reason: str = "") -> None:
        self._post("/abort_episode", {"reason": reason}, episode.api_key)

    def can_continue(self, episode: Episode) -> bool:
        return bool(self._post("/can_continue_episode", {}, episode.api_key)["can_continue"])

    def engine_status(self) -> dict[str, Any]:
        """``status`` (offline / booting / rolling / weight-syncing), ``policy_version``, ``queued``, ``running``."""
        return self._request("GET", "/get_engine_status", None, {})

    def train_config(self) -> dict[str, Any]:
        """The run's settings (model, sampling defaults, staleness, claim timeout)."""
        return self._post("/sync_train_config", {}, self._api_key)

    @contextlib.contextmanager
    def episode(self, timeout_s: float | None = None) -> Iterator[Episode]:
        """Claim an episode for a ``with`` block that must call ``episode.end(reward)``; an
        exception (or leaving without an end) gives the episode back to the queue."""
        episode = self.claim(timeout_s)
        try:
            yield episode
        except BaseException as error:
            if not episode.ended:
                with contextlib.suppress(Exception):
                    episode.abort(f"{type(error).__name__}: {error}")
            raise
        if not episode.ended:
            with contextlib.suppress(EpisodeServerError):
                episode.abort("the with-block ended without episode.end(reward)")
            raise RuntimeError("an episode's with-block must call episode.end(reward) before it ends")
