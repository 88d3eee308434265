"""Rollout: many agent runs at once, each a user's function talking to the model, and
the trajectories its calls make.

An agent is ordinary code that calls ``llm.chat.completions.create(messages=...)`` as it
would call OpenAI (`nexrl_core.run.llm_client.LLMClient`, which keeps every call). Once
the agent returns its reward, `build_trajectories` turns the calls into `Trajectory`
records:

- a call whose prompt starts with the previous call's full sequence (prompt + response)
  extends that trajectory: the new prompt tokens in between (tool output, the next user
  turn) get loss mask 0 and the new response tokens loss mask 1;
- any other call starts a new trajectory;
- every trajectory of a run carries the run's reward.

The `RolloutRunner` runs many agents at once on a thread pool bounded by
``rollout.concurrency``. Sampling seeds come from the `RunRequest` (call n of run r uses
``call_seed(group seed, n, r)``), so results do not depend on which thread ran what. An
agent that raises fails only its own run; the loop counts failures against the error
budget. A run whose prompt outgrew ``rollout.max_prompt_tokens`` stops training or is
dropped, as ``rollout.prompt_overflow`` says.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import numbers
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, Union

import attrs

from nexrl_core.chat.model import ChatModel
from nexrl_core.run.limits import PromptTooLong, TurnLimits, continues
from nexrl_core.run.llm_client import LLMClient, SamplingDefaults
from nexrl_core.types import SampleResult, Trajectory

logger = logging.getLogger("nexrl.rollout")


class RolloutError(RuntimeError):
    """Too many agent runs failed: the error budget is spent."""


# --- what one run is ------------------------------------------------------------------------------


AgentResult = Union[float, Mapping[str, Any]]
"""What an agent returns: the reward, or a mapping with ``reward`` and optional extra metrics."""


class Agent(Protocol):
    """User code that solves one task item with the LLM and scores the outcome.

    It calls ``llm.chat.completions.create(...)`` as it would an OpenAI client, as many
    times as it likes; every call's tokens and logprobs are recorded and trained on.
    """

    def __call__(self, item: Mapping[str, Any], llm: LLMClient) -> AgentResult: ...


@attrs.frozen(kw_only=True)
class RunRequest:
    """One agent run to perform: an item, where it sits in the run, and its seed."""

    step: int
    """Training step whose batch the run belongs to (1-based); for validation, the step
    after which it validates (0 before training)."""
    item_index: int
    """Position of the item within its step's batch (or within the validation set)."""
    run_id: int
    """Which of the ``group_size`` runs of this item (0..n-1)."""
    group_id: str
    """Shared by the runs of one item in one step."""
    task_id: str
    """Identifies the item in its dataset."""
    item: Mapping[str, Any] = attrs.field(eq=False)
    """The item the agent receives."""
    seed: int
    """Seed of the run's group (shared by its runs); the n-th LLM call of run r uses
    ``call_seed(seed, n, r)``."""
    is_val: bool = False

    def describe(self) -> str:
        """The run in words, for messages: its task item, step and run."""
        when = f"validation after step {self.step}" if self.is_val else f"step {self.step}"
        return f"task {self.task_id!r} ({when}, run {self.run_id})"


# --- trajectories ------------------------------------------------------------------------------------


def build_trajectories(
    calls: Sequence[SampleResult],
    *,
    reward: float,
    group_id: str,
    run_id: int | str,
    task_id: str,
    is_val: bool = False,
    extra: Mapping[str, Any] | None = None,
) -> list[Trajectory]:
    """Turn one run's LLM calls into trajectories (see the module docstring for the rule)."""
    pieces: list[tuple[list[int], list[int], list[float], list[int]]] = []
    for index, call in enumerate(calls):
        prompt = list(call.prompt_tokens)
        if continues(pieces[-1][0] if pieces else None, prompt):
            tokens, mask, logprobs, members = pieces[-1]
            gap = prompt[len(tokens) :]
            tokens.extend(gap)
            mask.extend([0] * len(gap))
            logprobs.extend([0.0] * len(gap))
        else:
            tokens, mask, logprobs, members = list(prompt), [0] * len(prompt), [0.0] * len(prompt), []
            pieces.append((tokens, mask, logprobs, members))
        tokens.extend(call.response_tokens)
        mask.extend([1] * len(call.response_tokens))
        logprobs.extend(float(value) for value in call.response_logprobs)
        members.append(index)
    return [
        Trajectory(
            tokens=tokens,
            loss_mask=mask,
            logprobs=logprobs,
            reward=reward,
            group_id=group_id,
            run_id=run_id,
            task_id=task_id,
            is_val=is_val,
            extra={**(extra or {}), "trajectory_index": position, "calls": members},
        )
        for position, (tokens, mask, logprobs, members) in enumerate(pieces)
    ]


# --- runs --------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class RunResult:
    """The outcome of one agent run."""

    step: int
    item_index: int
    run_id: int
    group_id: str
    task_id: str
    is_val: bool
    reward: float | None
    """None when the run failed."""
    trajectories: list[Trajectory] = attrs.field(factory=list)
    metrics: dict[str, float] = attrs.field(factory=dict)
    """Extra numbers the agent returned next to its reward."""
    num_calls: int = 0
    response_tokens: int = 0
    truncated_calls: int = 0
    """Calls cut by ``max_tokens`` (finish reason ``length``)."""
    error: str | None = None
    """``ExceptionType: message`` when the agent (or a call it made) raised."""
    skipped: str | None = None
    """Why the run was dropped (a prompt over ``rollout.max_prompt_tokens`` with
    ``rollout.prompt_overflow: skip``): it has no reward and no trajectories, and is
    not a failure, so it does not count against the error budget."""

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def finished(self) -> bool:
        """Neither failed nor skipped: the run has a reward."""
        return self.error is None and self.skipped is None

    def to_json(self) -> dict[str, Any]:
        """Plain data for the run-state file (pending batches of a one-step-off run)."""
        data = attrs.asdict(self, recurse=False)
        data["trajectories"] = [attrs.asdict(trajectory) for trajectory in self.trajectories]
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunResult:
        values = dict(data)
        values["trajectories"] = [Trajectory(**trajectory) for trajectory in values.get("trajectories", [])]
        return cls(**values)


def parse_outcome(outcome: Any) -> tuple[float, dict[str, float]]:
    """The reward and numeric extras of what an agent returned (a number or a mapping with ``reward``)."""
    extras: dict[str, float] = {}
    if isinstance(outcome, Mapping):
        if "reward" not in outcome:
            raise ValueError(f"the agent returned a mapping without 'reward' (keys: {', '.join(map(str, outcome))})")
        reward = outcome["reward"]
        for key, value in outcome.items():
            if key != "reward" and isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
                extras[str(key)] = float(value)
    else:
        reward = outcome
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        raise ValueError(f"the agent must return a finite number as its reward, got {reward!r}")
    return float(reward), extras


@attrs.frozen(kw_only=True)
class RolloutBatch:
    """The runs of one training step (or one validation), in request order."""

    step: int
    runs: list[RunResult]

    @property
    def trajectories(self) -> list[Trajectory]:
        return [trajectory for run in self.runs for trajectory in run.trajectories]

    @property
    def errors(self) -> list[RunResult]:
        return [run for run in self.runs if run.failed]

    def metrics(self, prefix: str = "") -> dict[str, float]:
        """Reward and rollout statistics; ``prefix`` is ``val/`` for validation."""
        ok = [run for run in self.runs if run.finished]
        rewards = [run.reward for run in ok if run.reward is not None]
        metrics: dict[str, float] = {
            f"{prefix}rollout/runs": float(len(self.runs)),
            f"{prefix}rollout/agent_errors": float(len(self.errors)),
            f"{prefix}rollout/skipped_runs": float(sum(run.skipped is not None for run in self.runs)),
        }
        if rewards:
            mean = math.fsum(rewards) / len(rewards)
            metrics[f"{prefix}reward/mean"] = mean
            metrics[f"{prefix}reward/std"] = math.sqrt(math.fsum((value - mean) ** 2 for value in rewards) / len(rewards))
            metrics[f"{prefix}reward/min"] = min(rewards)
            metrics[f"{prefix}reward/max"] = max(rewards)
        if ok:
            calls = sum(run.num_calls for run in ok)
            metrics[f"{prefix}rollout/trajectories"] = float(sum(len(run.trajectories) for run in ok))
            metrics[f"{prefix}rollout/calls_per_run"] = calls / len(ok)
            metrics[f"{prefix}rollout/response_tokens"] = float(sum(run.response_tokens for run in ok))
            metrics[f"{prefix}rollout/truncated_fraction"] = sum(run.truncated_calls for run in ok) / calls if calls else 0.0
            for key in sorted({key for run in ok for key in run.metrics}):
                values = [run.metrics[key] for run in ok if key in run.metrics]
                metrics[f"{prefix}agent/{key}"] = math.fsum(values) / len(values)
        return metrics

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "runs": [run.to_json() for run in self.runs]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RolloutBatch:
        return cls(step=data["step"], runs=[RunResult.from_json(run) for run in data["runs"]])


def check_error_budget(batch: RolloutBatch, *, fraction: float, total_errors: int, max_total: int | None, what: str) -> None:
    """Raise `RolloutError` when ``batch`` failed more runs than ``fraction`` of its runs, or
    the run's ``total_errors`` (this batch included) exceed ``max_total``."""
    failed = batch.errors
    if not failed:
        return
    first = failed[0]
    example = f"first failure (task {first.task_id}, run {first.run_id}): {first.error}"
    if len(failed) > fraction * len(batch.runs):
        raise RolloutError(
            f"{len(failed)} of {len(batch.runs)} agent runs failed in {what}, more than rollout.error_budget={fraction:g} allows; {example}"
        )
    if max_total is not None and total_errors > max_total:
        raise RolloutError(
            f"{total_errors} agent runs have failed so far, more than rollout.max_agent_errors={max_total} allows; "
            f"latest in {what}: {example}"
        )


class PendingBatch:
    """A batch being rolled out; `result` waits for every run (Ctrl-C interrupts the wait)."""

    def __init__(self, step: int, futures: list[concurrent.futures.Future[RunResult]]) -> None:
        self.step = step
        self._futures = futures

    def done(self) -> bool:
        return all(future.done() for future in self._futures)

    def result(self) -> RolloutBatch:
        return RolloutBatch(step=self.step, runs=[future.result() for future in self._futures])


class CompletedBatch(PendingBatch):
    """An already rolled-out batch, e.g. restored from a checkpoint."""

    def __init__(self, batch: RolloutBatch) -> None:
        super().__init__(batch.step, [])
        self._batch = batch

    def result(self) -> RolloutBatch:
        return self._batch


_LOGGED_TRACEBACKS = 5
"""Agent failures logged with a full traceback; later ones get one line each."""


class RolloutRunner:
    """The default rollout source: agent functions on a bounded thread pool, sampling from one chat model."""

    def __init__(
        self,
        chat_model: ChatModel,
        agent: Agent,
        *,
        concurrency: int,
        defaults: SamplingDefaults,
        model: str = "nexrl-policy",
        backend_lost: Callable[[], str | None] = lambda: None,
        limits: TurnLimits = TurnLimits(),
    ) -> None:
        """:param backend_lost: why a part of the backend died, if one did; runs failing
            meanwhile are logged in one line each (the failure is not the agent's).
        :param limits: the recipe's prompt and response limits, applied to every call."""
        self._chat_model = chat_model
        self._backend_lost = backend_lost
        self._agent = agent
        self._defaults = defaults
        self._limits = limits
        self._model = model
        self._stop = threading.Event()
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="nexrl-rollout")
        self._failures = 0
        self._skips = 0
        self._failures_lock = threading.Lock()

    def submit(self, step: int, requests: Sequence[RunRequest], temperature: float | None = None) -> PendingBatch:
        """Start every request; ``temperature`` replaces the default (validation uses its own)."""
        defaults = self._defaults if temperature is None else attrs.evolve(self._defaults, temperature=temperature)
        futures = [self._executor.submit(self._run, request, defaults) for request in requests]
        return PendingBatch(step, futures)

    def _run(self, request: RunRequest, defaults: SamplingDefaults) -> RunResult:
        """One agent run; a prompt over ``rollout.max_prompt_tokens`` drops it (``skip``)
        or raises `RolloutError`, which stops the step and so the training run (``error``)."""
        client = LLMClient(
            self._chat_model,
            defaults,
            request.seed,
            run_id=request.run_id,
            model=self._model,
            stop_event=self._stop,
            limits=self._limits,
        )
        base: dict[str, Any] = dict(
            step=request.step,
            item_index=request.item_index,
            run_id=request.run_id,
            group_id=request.group_id,
            task_id=request.task_id,
            is_val=request.is_val,
        )
        failure: Exception | None = None
        outcome: Any = None
        try:
            outcome = self._agent(request.item, client)
        except PromptTooLong:
            pass  # kept in client.overflow, like one the agent swallowed
        except Exception as error:  # an agent's bug fails its own run only
            failure = error
        if client.overflow is not None:  # whatever the agent made of it, the refusal decides
            return self._overflowed(request, client.overflow, base, len(client.calls))
        if failure is None:
            try:
                reward, extras = parse_outcome(outcome)
                trajectories = build_trajectories(
                    client.calls,
                    reward=reward,
                    group_id=request.group_id,
                    run_id=request.run_id,
                    task_id=request.task_id,
                    is_val=request.is_val,
                    extra={"step": request.step},
                )
            except Exception as error:  # a bad reward fails its own run only
                failure = error
        if failure is not None:
            self._log_failure(request, failure)
            return RunResult(**base, reward=None, num_calls=len(client.calls), error=f"{type(failure).__name__}: {failure}")
        return RunResult(
            **base,
            reward=reward,
            trajectories=trajectories,
            metrics=extras,
            num_calls=len(client.calls),
            response_tokens=sum(len(call.response_tokens) for call in client.calls),
            truncated_calls=sum(call.finish_reason == "length" for call in client.calls),
        )

    def _overflowed(self, request: RunRequest, overflow: PromptTooLong, base: dict[str, Any], calls: int) -> RunResult:
        """The run of a refused prompt: dropped (``skip``, the first logged as a warning) or,
        for ``error``, a `RolloutError` that ends the step's wait and so the training run."""
        line = overflow.line(request.describe())
        if not overflow.skip:
            raise RolloutError(line)
        with self._failures_lock:
            self._skips += 1
            first = self._skips == 1
        if first:
            logger.warning("%s; later skips are counted in rollout/skipped_runs", line)
        else:
            logger.debug("%s", line)
        return RunResult(**base, reward=None, num_calls=calls, skipped=line)

    def _log_failure(self, request: RunRequest, error: Exception) -> None:
        with self._failures_lock:
            self._failures += 1
            count = self._failures
        where = f"{'validation' if request.is_val else 'step'} {request.step}, task {request.task_id}, run {request.run_id}"
        lost = self._backend_lost()
        if lost is not None:
            logger.warning("agent run failed (%s) because %s: %s: %s", where, lost, type(error).__name__, error)
        elif count <= _LOGGED_TRACEBACKS:
            logger.warning(
                "agent run failed (%s):\n%s",
                where,
                "".join(traceback.format_exception(type(error), error, error.__traceback__)),
            )
        else:
            logger.warning("agent run failed (%s): %s: %s", where, type(error).__name__, error)

    def close(self) -> None:
        """Stop: agents still running fail at their next LLM call, queued runs never start,
        and every worker thread has ended when this returns."""
        self._stop.set()
        self._executor.shutdown(wait=True, cancel_futures=True)
