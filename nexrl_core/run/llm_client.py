"""`LLMClient`: the OpenAI-shaped client an agent calls, backed by the backend's `ChatModel`.

An agent calls ``llm.chat.completions.create(messages=...)`` as it would call OpenAI. Each
call renders its prompt with the model's chat template, samples within the recipe's
`TurnLimits` (``rollout.max_prompt_tokens``, ``rollout.prompt_overflow``,
``rollout.max_response_tokens``; `nexrl_core.run.limits`) with the seed
``call_seed(group seed, n, r)`` for call n of run r, and is kept, so that
`nexrl_core.run.rollout.build_trajectories` can turn a run's calls into trajectories.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from nexrl_core.chat.model import ChatModel, SamplingOptions
from nexrl_core.run.completions import ChatCompletion, completion_from_sample
from nexrl_core.run.limits import PromptTooLong, ResponseBudget, TurnLimits, spent_turn
from nexrl_core.run.seeding import call_seed
from nexrl_core.types import SampleResult


class RolloutCancelled(BaseException):
    """Raised inside an agent's LLM call when the run is stopping (Ctrl-C).

    It derives from BaseException so an agent's ``except Exception`` does not swallow it.
    """


@attrs.frozen(kw_only=True)
class SamplingDefaults:
    """Sampling settings a call gets when the agent does not pass them."""

    max_tokens: int
    temperature: float
    top_p: float = 1.0


class _Completions:
    def __init__(self, client: LLMClient) -> None:
        self._client = client

    def create(self, **kwargs: Any) -> ChatCompletion:
        """``openai.OpenAI().chat.completions.create`` for the policy being trained."""
        return self._client._create(**kwargs)


class _Chat:
    def __init__(self, client: LLMClient) -> None:
        self.completions = _Completions(client)


_IGNORED_TOOL_CHOICES = (None, "auto")


def _as_dict(value: Any, what: str) -> dict[str, Any]:
    """A message or tool as a plain dict; our own `ChatCompletionMessage` (appended to the
    conversation as OpenAI's SDK allows) becomes its OpenAI dict."""
    if isinstance(value, Mapping):
        return dict(value)
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        message: dict[str, Any] = to_dict()
        return message
    raise TypeError(f"{what} must hold mappings (or ChatCompletionMessage objects), got {type(value).__name__}")


class LLMClient:
    """The model as an OpenAI-style client, for one agent run.

    ``llm.chat.completions.create(messages=..., tools=None, max_tokens=None,
    temperature=None, top_p=None, stop=None)`` samples one assistant turn. Arguments left
    out take the recipe's ``rollout`` values. ``model`` is accepted and ignored (the run
    trains one model); ``n`` must be 1; a ``seed`` is mixed into the seed NexRL derives for
    the call, so equal user seeds do not make a group's runs identical.

    Every call's `SampleResult` is kept in `calls`, in call order. Calls are safe from
    several threads, but their order (and so their seeds) then follows the threads.

    Each call is sampled within ``limits``: a prompt over ``max_prompt_tokens`` is cut
    (``truncate_left``) or raises `PromptTooLong` into the agent, also kept in
    `overflow` so that an agent catching it cannot hide it; a call whose trajectory has
    spent ``max_response_tokens`` is answered with no tokens, finish reason ``length``,
    and not kept in `calls` (nothing was sampled).
    """

    def __init__(
        self,
        chat_model: ChatModel,
        defaults: SamplingDefaults,
        seed: int,
        run_id: int = 0,
        model: str = "nexrl-policy",
        stop_event: threading.Event | None = None,
        limits: TurnLimits = TurnLimits(),
    ) -> None:
        self.chat = _Chat(self)
        self.calls: list[SampleResult] = []
        self.overflow: PromptTooLong | None = None
        """The first call refused for its prompt's length; the run ends with it."""
        self._chat_model = chat_model
        self._limits = limits
        self._budget = ResponseBudget()
        self._defaults = defaults
        self._seed = seed
        self._run_id = run_id
        self._model = model
        self._stop_event = stop_event
        self._lock = threading.Lock()
        self._started = 0

    def _create(
        self,
        *,
        messages: Sequence[Mapping[str, Any]],
        model: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = None,
        max_tokens: int | None = None,
        max_completion_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        n: int | None = None,
        **unsupported: Any,
    ) -> ChatCompletion:
        if unsupported:
            raise TypeError(
                "chat.completions.create() got arguments NexRL's LLM client does not support: "
                f"{', '.join(sorted(unsupported))}; supported: messages, model, tools, tool_choice, max_tokens, "
                "max_completion_tokens, temperature, top_p, stop, seed, n"
            )
        if n not in (None, 1):
            raise ValueError(f"n={n!r}: NexRL samples one completion per call; make several calls instead")
        if tool_choice not in _IGNORED_TOOL_CHOICES:
            raise ValueError(f"tool_choice={tool_choice!r} is not supported; leave it unset or 'auto'")
        if self._stop_event is not None and self._stop_event.is_set():
            raise RolloutCancelled("the training run is stopping")
        with self._lock:
            index = self._started
            self._started += 1
        seed_of_call = call_seed(self._seed, index, self._run_id, seed)
        options = SamplingOptions(
            max_tokens=max_tokens or max_completion_tokens or self._defaults.max_tokens,
            temperature=self._defaults.temperature if temperature is None else temperature,
            top_p=self._defaults.top_p if top_p is None else top_p,
            stop=[stop] if isinstance(stop, str) else (list(stop) if stop is not None else None),
            seed=seed_of_call,
        )
        prompt = self._chat_model.apply_chat_template(
            [_as_dict(message, "messages") for message in messages],
            tools=[_as_dict(tool, "tools") for tool in tools] if tools else None,
            add_generation_prompt=True,
            tokenize=True,
        )
        if isinstance(prompt, str):
            raise TypeError("the chat model's apply_chat_template(tokenize=True) returned text, not token ids")
        with self._lock:
            try:
                plan = self._limits.plan(prompt, options, budget=self._budget, call=index)
            except PromptTooLong as overflow:
                self.overflow = self.overflow or overflow
                raise
        if plan.spent:
            sample = spent_turn(plan.prompt)
        else:
            sample = self._chat_model.sample_from_prompt(plan.prompt, plan.options)
            if not isinstance(sample, SampleResult):
                raise TypeError(f"the chat model's sample_from_prompt returned {type(sample).__name__}, not a SampleResult")
            with self._lock:
                self.calls.append(sample)
                self._budget.add(sample)
        return completion_from_sample(sample, completion_id=f"chatcmpl-{seed_of_call:08x}", model=model or self._model)
