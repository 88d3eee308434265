"""The episode book: which episodes wait, who holds which, and what each has recorded.

It is the server's one source of truth while it runs, kept in memory for speed and
written through to the `EpisodeStore` before any answer leaves the server. One lock
serialises every change, so the HTTP routes (event loop), the model calls (worker
threads), the stale-claim janitor and the training loop (`EpisodeSource`) can all use it.

Life of an episode: ``queued`` → claimed by a client (``claimed``; the claim's key is
the only key that works for it) → ``ended`` with a reward, which resolves the future
the training loop waits on. A client that aborts, or that shows no activity (claim,
model call, ``can_continue``) for ``claim_timeout_s``, loses the claim: the episode
goes back to the queue with a new attempt number, what it recorded is discarded, and
the old key is refused from then on. After ``max_attempts`` claims the run fails
instead, so a step never waits forever on an episode that crashes every client.

Model calls are planned here (`plan_call`), under the lock that orders the episode's
recorded calls, with the core's `nexrl_core.run.limits.TurnLimits` and one
`ResponseBudget` per attempt: the limits act exactly as in the ``threads`` source. A
prompt over ``rollout.max_prompt_tokens`` ends the episode there: ``skip`` drops its run
(status ``skipped``), ``error`` fails the step's wait with a `RolloutError`, which stops
training with the refusal's line.
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
import numbers
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from nexrl_core.chat.model import SamplingOptions
from nexrl_core.run.limits import PromptTooLong, ResponseBudget, TurnLimits, TurnPlan
from nexrl_core.run.llm_client import SamplingDefaults
from nexrl_core.run.rollout import RolloutError, RunRequest, RunResult, build_trajectories, parse_outcome
from nexrl_core.types import SampleResult
from nexrl_episodes.store import EpisodeStore, NewEpisode
from nexrl_episodes.tokens import EpisodeTokens, InvalidToken, TokenClaim

ENGINE_STATUSES = ("offline", "booting", "rolling", "weight-syncing")


class EpisodeError(Exception):
    """A request the book refuses; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def request_key(request: RunRequest) -> str:
    """What identifies a run request across a restart of the server."""
    kind = "val" if request.is_val else "train"
    return f"{kind}:{request.step}:{request.item_index}:{request.run_id}:{request.seed}"


@attrs.define(kw_only=True)
class LiveEpisode:
    """An episode as the running server knows it."""

    episode_id: str
    request: RunRequest
    sampling: SamplingDefaults
    policy_version: int
    attempt: int
    status: str = "queued"
    claims: int = 0
    client_id: str | None = None
    last_activity: float = 0.0
    calls: list[SampleResult] = attrs.field(factory=list)
    next_call: int = 0
    """Index of the next model call of this attempt (seeds the call)."""
    in_flight: int = 0
    """Model calls the server is answering for it: a claim is never stale while one runs."""
    budget: ResponseBudget = attrs.field(factory=ResponseBudget)
    """Response tokens of this attempt's trajectories (``rollout.max_response_tokens``)."""
    future: concurrent.futures.Future[RunResult] = attrs.field(factory=concurrent.futures.Future)


def _sample_to_json(sample: SampleResult) -> dict[str, Any]:
    return attrs.asdict(sample)


def _result_of(request: RunRequest, **outcome: Any) -> RunResult:
    """The `RunResult` of ``request``'s run: who it is from the request, how it went
    (``reward``, and calls and trajectories, an ``error`` or why it was ``skipped``) from ``outcome``."""
    return RunResult(
        step=request.step,
        item_index=request.item_index,
        run_id=request.run_id,
        group_id=request.group_id,
        task_id=request.task_id,
        is_val=request.is_val,
        **outcome,
    )


def _run_result(request: RunRequest, reward: float, metrics: Mapping[str, float], calls: Sequence[SampleResult]) -> RunResult:
    """An ended run: its trajectories built from the recorded ``calls`` as the ``threads`` source builds them."""
    return _result_of(
        request,
        reward=reward,
        trajectories=build_trajectories(
            calls,
            reward=reward,
            group_id=request.group_id,
            run_id=request.run_id,
            task_id=request.task_id,
            is_val=request.is_val,
            extra={"step": request.step},
        ),
        metrics=dict(metrics),
        num_calls=len(calls),
        response_tokens=sum(len(call.response_tokens) for call in calls),
        truncated_calls=sum(call.finish_reason == "length" for call in calls),
    )


def parse_reward(reward: Any, metadata: Any) -> tuple[float, dict[str, float]]:
    """The reward and numeric metrics of an ``end_episode`` body, or a 422 naming what is wrong."""
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        raise EpisodeError(422, f"reward must be a finite number, got {reward!r}")
    if metadata is not None and not isinstance(metadata, Mapping):
        raise EpisodeError(422, f"metadata must be a JSON object, got {type(metadata).__name__}")
    return parse_outcome({**(metadata or {}), "reward": reward})


class EpisodeBook:
    """Queue, claims and results of the episodes of one server."""

    def __init__(
        self,
        store: EpisodeStore,
        *,
        claim_timeout_s: float,
        max_attempts: int,
        max_staleness: int = 0,
        model: str = "nexrl-policy",
        limits: TurnLimits = TurnLimits(),
    ) -> None:
        self.store = store
        self.limits = limits
        """The recipe's prompt and response limits, applied to every model call."""
        self.tokens = EpisodeTokens(store.secret(uuid.uuid4().bytes + uuid.uuid4().bytes))
        self.claim_timeout_s = claim_timeout_s
        self.max_attempts = max_attempts
        self.max_staleness = max_staleness
        self.model = model
        self.policy_version = 0
        """Weight version sampling serves now (bumped by the training loop's source)."""
        self._lock = threading.Lock()
        self._queue: collections.deque[str] = collections.deque()
        self._live: dict[str, LiveEpisode] = {}
        self._closed = False
        self._registered = False
        self.listeners: list[Callable[[], None]] = []
        """Called (from any thread, without the lock) whenever episodes join the queue or the book closes."""
        self._outstanding = 0
        """Episodes queued or claimed: what the training loop still waits for."""

    @property
    def engine_status(self) -> str:
        """``offline`` (stopped), ``booting`` (nothing registered yet), ``rolling`` (episodes
        wait to be claimed or ended) or ``weight-syncing`` (the loop is training and
        publishing weights; new episodes follow)."""
        if self._closed:
            return "offline"
        if not self._registered:
            return "booting"
        return "rolling" if self._outstanding else "weight-syncing"

    # --- the training side

    def register(self, requests: Sequence[RunRequest], sampling: SamplingDefaults) -> list[concurrent.futures.Future[RunResult]]:
        """Queue an episode per request; a request whose episode already ended (in an
        earlier life of this server) is answered from the store without running again."""
        keys = [request_key(request) for request in requests]
        existing = self.store.find(keys)
        futures: list[concurrent.futures.Future[RunResult]] = []
        new: list[NewEpisode] = []
        requeued: list[tuple[str, int, int]] = []
        with self._lock:
            if self._closed:
                raise RuntimeError("the episode server is closed")
            version = self.policy_version
            queued: list[str] = []
            for request, key in zip(requests, keys):
                row = existing.get(key)
                if row is not None and row["status"] == "ended":
                    future: concurrent.futures.Future[RunResult] = concurrent.futures.Future()
                    calls = [SampleResult(**call) for call in row["calls"] or []]
                    future.set_result(_run_result(request, row["reward"], row["metrics"] or {}, calls))
                    futures.append(future)
                    continue
                if row is not None:
                    episode = LiveEpisode(
                        episode_id=row["episode_id"],
                        request=request,
                        sampling=sampling,
                        policy_version=version,
                        attempt=row["attempt"] + 1,
                    )
                    requeued.append((episode.episode_id, episode.attempt, version))
                else:
                    episode = LiveEpisode(
                        episode_id=uuid.uuid4().hex, request=request, sampling=sampling, policy_version=version, attempt=0
                    )
                    new.append(
                        NewEpisode(
                            episode_id=episode.episode_id,
                            request_key=key,
                            step=request.step,
                            item_index=request.item_index,
                            run_id=request.run_id,
                            group_id=request.group_id,
                            task_id=request.task_id,
                            is_val=request.is_val,
                            seed=request.seed,
                            item=dict(request.item),
                            sampling=attrs.asdict(sampling),
                            policy_version=version,
                        )
                    )
                self._live[episode.episode_id] = episode
                queued.append(episode.episode_id)
                futures.append(episode.future)
            self.store.add(new, requeued)
            self._queue.extend(queued)
            self._registered = True
            self._outstanding += len(queued)
        self._notify()
        return futures

    def _notify(self) -> None:
        for listener in list(self.listeners):
            listener()

    def set_policy_version(self, version: int) -> None:
        with self._lock:
            self.policy_version = version

    def close(self) -> None:
        """Fail every run still waiting (the loop is stopping) and refuse new claims."""
        with self._lock:
            self._closed = True
            self._queue.clear()
            self._outstanding = 0
            for episode in self._live.values():
                if episode.status in ("queued", "claimed"):
                    episode.status = "dropped"
                    self.store.finish(episode.episode_id, "dropped", "the training run stopped before it ended")
                    if not episode.future.done():
                        episode.future.set_result(
                            _result_of(episode.request, reward=None, error="RolloutCancelled: the training run is stopping")
                        )
        self._notify()

    # --- the client side

    def claim(self, client_id: str | None) -> tuple[LiveEpisode, str] | None:
        """The oldest queued episode, now claimed, with its key; None when none waits."""
        with self._lock:
            while self._queue:
                episode = self._live[self._queue.popleft()]
                if episode.status != "queued":
                    continue
                # Not written to the store: a restarted server requeues claimed and queued
                # episodes alike, and the claim's attempt (what its key signs) is already stored.
                episode.status = "claimed"
                episode.claims += 1
                episode.client_id = client_id
                episode.last_activity = time.monotonic()
                return episode, self.tokens.issue(episode.episode_id, episode.attempt)
            return None

    def return_undelivered(self, episode: LiveEpisode) -> None:
        """Put back a claim whose answer could not reach its client (it hung up while waiting):
        it was never used, so it does not count against ``max_attempts``."""
        with self._lock:
            if episode.status != "claimed":
                return
            episode.claims -= 1
            episode.attempt += 1
            episode.status = "queued"
            self.store.requeue(episode.episode_id, episode.attempt)
            self._queue.appendleft(episode.episode_id)
        self._notify()

    def _token_claim(self, token: str | None) -> TokenClaim:
        """What ``token`` names, or a 401 saying why it is no key of this server."""
        if not token:
            raise EpisodeError(401, "missing episode key: send the api_key a claim returned as 'Authorization: Bearer <key>'")
        try:
            return self.tokens.check(token)
        except InvalidToken as error:
            raise EpisodeError(401, str(error)) from None

    def _episode_of(self, token: str | None) -> tuple[LiveEpisode, int]:
        claim = self._token_claim(token)
        episode = self._live.get(claim.episode_id)
        if episode is None:
            raise EpisodeError(404, f"episode {claim.episode_id} is not one this server is running")
        return episode, claim.attempt

    def _claimed(self, token: str | None) -> LiveEpisode:
        """The episode ``token`` holds a live claim on (activity refreshed), or the reason why not."""
        return self._held(*self._episode_of(token))

    def _held(self, episode: LiveEpisode, attempt: int) -> LiveEpisode:
        """``episode``, if claim ``attempt`` of it is live (activity refreshed), or the reason why not."""
        if attempt != episode.attempt:
            raise EpisodeError(
                409,
                f"episode {episode.episode_id}: this key belongs to an earlier claim that went back to the queue "
                f"(no activity for {self.claim_timeout_s:g} s, or aborted); claim a new episode",
            )
        if episode.status != "claimed":
            raise EpisodeError(409, f"episode {episode.episode_id} is {episode.status}: its key no longer works")
        episode.last_activity = time.monotonic()
        return episode

    def start_call(self, token: str | None, episode_id: str) -> tuple[LiveEpisode, int, int]:
        """Check a model call's key for ``episode_id``'s endpoint; returns the episode, the attempt and the call's index."""
        with self._lock:
            episode = self._claimed(token)
            if episode.episode_id != episode_id:
                raise EpisodeError(403, f"this key belongs to episode {episode.episode_id}, not {episode_id}")
            index = episode.next_call
            episode.next_call += 1
            episode.in_flight += 1
            return episode, episode.attempt, index

    def end_call(self, episode: LiveEpisode) -> None:
        """A call of `start_call` has been answered (or refused); its episode's silence counts again from now."""
        with self._lock:
            episode.in_flight -= 1
            episode.last_activity = time.monotonic()

    def reserve_calls(self, episode: LiveEpisode, attempt: int, count: int) -> int:
        """Reserve ``count - 1`` more call indices after one from `start_call` (for ``n`` > 1); returns the next."""
        with self._lock:
            if episode.attempt != attempt:
                raise EpisodeError(409, f"episode {episode.episode_id} went back to the queue during the call")
            first = episode.next_call
            episode.next_call += count
            return first

    def plan_call(self, episode: LiveEpisode, attempt: int, prompt: Sequence[int], options: SamplingOptions, call: int) -> TurnPlan:
        """What model call ``call`` of the episode samples within the run's limits. A
        prompt over ``rollout.max_prompt_tokens`` (``error`` or ``skip``) ends the episode
        and is answered with a 400 carrying the refusal's line (not a 409, which OpenAI
        clients retry and would then hear only that the key no longer works)."""
        with self._lock:
            if episode.attempt != attempt or episode.status != "claimed":
                raise EpisodeError(409, f"episode {episode.episode_id} lost its claim before its model call; claim a new episode")
            try:
                return self.limits.plan(prompt, options, budget=episode.budget, call=call)
            except PromptTooLong as overflow:
                line = overflow.line(f"{episode.request.describe()}, episode {episode.episode_id}")
                calls = len(episode.calls)
                episode.calls = []
                self._outstanding -= 1
                if overflow.skip:
                    episode.status = "skipped"
                    self.store.finish(episode.episode_id, "skipped", line)
                    episode.future.set_result(_result_of(episode.request, reward=None, num_calls=calls, skipped=line))
                    raise EpisodeError(400, f"{line}; claim a new episode") from None
                episode.status = "failed"
                self.store.finish(episode.episode_id, "failed", line)
                episode.future.set_exception(RolloutError(line))
                raise EpisodeError(400, line) from None

    def record_calls(self, episode: LiveEpisode, attempt: int, samples: Sequence[SampleResult]) -> None:
        """Keep a finished call's samples for the episode's trajectory (refused if the claim was lost meanwhile)."""
        with self._lock:
            if episode.attempt != attempt or episode.status != "claimed":
                raise EpisodeError(409, f"episode {episode.episode_id} lost its claim while the model was answering; claim a new episode")
            episode.calls.extend(samples)
            for sample in samples:
                episode.budget.add(sample)
            episode.last_activity = time.monotonic()

    def end(self, token: str | None, episode_id: str, reward: Any, metadata: Any) -> bool:
        """Record the reward (committed before returning) and resolve the run; True for a
        repeat of an end that was already recorded, which changes nothing."""
        value, metrics = parse_reward(reward, metadata)
        with self._lock:
            claim = self._token_claim(token)
            episode = self._live.get(claim.episode_id)
            if episode is None:
                if claim.episode_id == episode_id and self._ended_earlier(claim):
                    return True
                raise EpisodeError(404, f"episode {claim.episode_id} is not one this server is running")
            if episode.episode_id != episode_id:
                raise EpisodeError(403, f"this key belongs to episode {episode.episode_id}, not {episode_id}")
            if episode.status == "ended" and claim.attempt == episode.attempt:
                self.store.count_duplicate_end(episode.episode_id)
                return True
            episode = self._held(episode, claim.attempt)
            calls = list(episode.calls)
            if not self.store.end(
                episode.episode_id,
                episode.attempt,
                value,
                metrics,
                [_sample_to_json(call) for call in calls],
                time.time(),
                episode.client_id,
            ):
                raise EpisodeError(409, f"episode {episode.episode_id} is not claimed in the store; claim a new episode")
            episode.status = "ended"
            episode.calls = []
            self._outstanding -= 1
        episode.future.set_result(_run_result(episode.request, value, metrics, calls))
        return False

    def _ended_earlier(self, claim: TokenClaim) -> bool:
        """True (and counted) for a repeated end of an episode that ended in an earlier life of this server."""
        row = self.store.get(claim.episode_id)
        if row is None or row["status"] != "ended" or row["attempt"] != claim.attempt:
            return False
        self.store.count_duplicate_end(claim.episode_id)
        return True

    def abort(self, token: str | None, reason: str = "") -> None:
        """Give the episode back: it goes to the queue (or fails when out of attempts)."""
        with self._lock:
            episode = self._claimed(token)
            self._release(episode, f"aborted by its client{': ' + reason if reason else ''}")
        self._notify()

    def can_continue(self, token: str | None) -> tuple[bool, str]:
        """Whether the claim is live and the weights have not moved past the allowed staleness."""
        with self._lock:
            try:
                episode = self._claimed(token)
            except EpisodeError as error:
                if error.status == 401:
                    raise
                return False, error.message
            behind = self.policy_version - episode.policy_version
            if behind > self.max_staleness:
                return False, (
                    f"the policy moved {behind} updates past this episode's weights, more than rollout.max_staleness={self.max_staleness}"
                )
            return True, ""

    def requeue_stale(self) -> int:
        """Put claims with no activity for ``claim_timeout_s`` back in the queue; returns how many."""
        deadline = time.monotonic() - self.claim_timeout_s
        with self._lock:
            stale = [
                episode
                for episode in self._live.values()
                if episode.status == "claimed" and not episode.in_flight and episode.last_activity < deadline
            ]
            for episode in stale:
                self._release(episode, f"no activity for {self.claim_timeout_s:g} s")
        if stale:
            self._notify()
        return len(stale)

    def _release(self, episode: LiveEpisode, why: str) -> None:
        episode.attempt += 1
        episode.calls = []
        episode.budget = ResponseBudget()
        episode.next_call = 0
        episode.client_id = None
        if episode.claims >= self.max_attempts:
            episode.status = "failed"
            self._outstanding -= 1
            error = f"EpisodeFailed: claimed {episode.claims} times without ending (last: {why})"
            self.store.finish(episode.episode_id, "failed", error)
            episode.future.set_result(_result_of(episode.request, reward=None, error=error))
            return
        episode.status = "queued"
        self.store.requeue(episode.episode_id, episode.attempt)
        self._queue.append(episode.episode_id)

    # --- status

    def queued(self) -> int:
        with self._lock:
            return sum(1 for episode_id in self._queue if self._live[episode_id].status == "queued")

    def running(self) -> int:
        with self._lock:
            return sum(1 for episode in self._live.values() if episode.status == "claimed")
