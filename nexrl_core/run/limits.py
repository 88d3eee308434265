"""How long a model turn's prompt and a trajectory's responses may be, for every rollout source.

``rollout.max_prompt_tokens`` (with ``rollout.prompt_overflow``) and
``rollout.max_response_tokens`` act on token ids, so they are enforced here, between the
chat template and the sampler, where every rollout passes whatever runs the model: the
``threads`` source's `nexrl_core.run.llm_client.LLMClient` and the episode server's OpenAI
endpoints both render the prompt, ask `TurnLimits.plan` what to sample, and keep a
`ResponseBudget` per run. One implementation, so two sources or two backends cut the
same prompt at the same token.

A trajectory is what `nexrl_core.run.rollout.build_trajectories` makes of a run's calls: a
call whose prompt starts with the previous call's prompt and response continues it
(`continues`), any other call starts a new one. The response budget follows the same
rule, so every trajectory trained on holds at most ``max_response_tokens`` response tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from nexrl_core.chat.model import SamplingOptions
from nexrl_core.config.schema import PromptOverflow, RolloutConfig
from nexrl_core.types import SampleResult

__all__ = ["PromptTooLong", "ResponseBudget", "TurnLimits", "TurnPlan", "continues", "context_problems", "spent_turn"]


def continues(sequence: Sequence[int] | None, prompt: Sequence[int]) -> bool:
    """Whether a call with ``prompt`` continues the trajectory whose tokens so far are
    ``sequence`` (None: there is none yet): the prompt starts with all of them."""
    return sequence is not None and len(prompt) >= len(sequence) and list(prompt[: len(sequence)]) == list(sequence)


class PromptTooLong(BaseException):
    """A model call's prompt is over ``rollout.max_prompt_tokens`` and the recipe's
    ``prompt_overflow`` is ``error`` or ``skip``.

    Raised inside the agent's model call to end its run there. It derives from
    BaseException so an agent's ``except Exception`` does not swallow it; the rollout
    source then stops training with `line` (``error``) or drops the run (``skip``).
    """

    def __init__(self, *, length: int, limit: int, overflow: PromptOverflow, call: int) -> None:
        super().__init__(f"a prompt of {length} tokens is over rollout.max_prompt_tokens={limit}")
        self.length = length
        self.limit = limit
        self.overflow = overflow
        self.call = call
        """Index of the model call in its run (0 is the first)."""

    @property
    def skip(self) -> bool:
        """True when the recipe drops such runs instead of stopping."""
        return self.overflow is PromptOverflow.SKIP

    def line(self, where: str) -> str:
        """The one line that names the key, the limit, the prompt's length and ``where``
        (the task item and run), and what to change."""
        if self.skip:
            return (
                f"rollout.max_prompt_tokens: {where} skipped: the prompt of its model call {self.call + 1} has "
                f"{self.length} tokens, over the limit of {self.limit} (rollout.prompt_overflow: skip)"
            )
        return (
            f"rollout.max_prompt_tokens: the prompt of model call {self.call + 1} of {where} has {self.length} tokens, "
            f"over the limit of {self.limit}; raise rollout.max_prompt_tokens, or set rollout.prompt_overflow to "
            "truncate_left (keep the last tokens) or skip (drop such runs)"
        )


@attrs.frozen(kw_only=True)
class TurnPlan:
    """What one model call samples after `TurnLimits.plan`."""

    prompt: list[int]
    """The prompt to sample after: the call's own, or its tail under ``truncate_left``."""
    options: SamplingOptions
    """The call's options with ``max_tokens`` capped by the trajectory's budget."""
    spent: bool = False
    """True when the trajectory has no response tokens left: answer with `spent_turn`
    and sample nothing."""


@attrs.frozen(kw_only=True)
class TurnLimits:
    """The recipe's limits on one model turn and one trajectory (``rollout.max_prompt_tokens``,
    ``rollout.prompt_overflow``, ``rollout.max_response_tokens``); see `RolloutConfig`."""

    max_prompt_tokens: int | None = None
    prompt_overflow: PromptOverflow = PromptOverflow.ERROR
    max_response_tokens: int | None = None

    @classmethod
    def of(cls, rollout: RolloutConfig) -> TurnLimits:
        return cls(
            max_prompt_tokens=rollout.max_prompt_tokens,
            prompt_overflow=rollout.prompt_overflow,
            max_response_tokens=rollout.max_response_tokens,
        )

    def plan(self, prompt: Sequence[int], options: SamplingOptions, *, budget: ResponseBudget, call: int) -> TurnPlan:
        """What call ``call`` of a run samples, given its rendered ``prompt``, its
        ``options`` and the run's ``budget`` (read, not changed: the source adds the
        sample once it records it).

        :raises PromptTooLong: when the prompt is over ``max_prompt_tokens`` and the
            overflow policy is ``error`` or ``skip``.
        """
        tokens = [int(token) for token in prompt]
        limit = self.max_prompt_tokens
        if limit is not None and len(tokens) > limit:
            if self.prompt_overflow is not PromptOverflow.TRUNCATE_LEFT:
                raise PromptTooLong(length=len(tokens), limit=limit, overflow=self.prompt_overflow, call=call)
            tokens = tokens[len(tokens) - limit :]
        if self.max_response_tokens is None:
            return TurnPlan(prompt=tokens, options=options)
        left = self.max_response_tokens - budget.used_by(tokens)
        if left <= 0:
            return TurnPlan(prompt=tokens, options=options, spent=True)
        return TurnPlan(prompt=tokens, options=attrs.evolve(options, max_tokens=min(options.max_tokens, left)))


def spent_turn(prompt: Sequence[int]) -> SampleResult:
    """The answer to a call whose trajectory has used all of ``rollout.max_response_tokens``:
    no tokens, finish reason ``length`` (as a turn cut by ``max_tokens``). Nothing was
    sampled, so the rollout source does not record it for training."""
    return SampleResult(
        prompt_tokens=[int(token) for token in prompt],
        response_tokens=[],
        response_logprobs=[],
        response_text="",
        finish_reason="length",
    )


class ResponseBudget:
    """Response tokens of the trajectory each new call would continue, for one run.

    Feed it every recorded call in the order the run's trajectories are built from
    (`add`); `used_by` then answers for a new prompt by the rule of `continues`. Not
    thread-safe: a source calls it under the lock that orders its recorded calls.
    """

    def __init__(self) -> None:
        self._sequence: list[int] | None = None
        """Prompt and response tokens of the trajectory the last call extended."""
        self._used = 0
        """Response tokens in that trajectory."""

    def used_by(self, prompt: Sequence[int]) -> int:
        """Response tokens already in the trajectory ``prompt`` continues; 0 for a new one."""
        return self._used if continues(self._sequence, prompt) else 0

    def add(self, sample: SampleResult) -> None:
        """Count a recorded call into the trajectory it continues, or start a new one."""
        if continues(self._sequence, sample.prompt_tokens):
            assert self._sequence is not None
            self._sequence.extend(sample.prompt_tokens[len(self._sequence) :])
            self._used += len(sample.response_tokens)
        else:
            self._sequence = list(sample.prompt_tokens)
            self._used = len(sample.response_tokens)
        self._sequence.extend(sample.response_tokens)


def context_problems(rollout: RolloutConfig, model: str | None, context: int, source: str) -> list[str]:
    """Why the recipe's per-turn lengths do not fit a model whose context is ``context``
    tokens (``source`` says who reports it); empty when they fit.

    A turn needs its prompt and its response in the context: ``rollout.max_tokens``
    alone must leave room for a prompt, and with ``rollout.max_prompt_tokens`` the two
    together must fit.
    """
    if rollout.max_tokens >= context:
        return [
            f"rollout.max_tokens: {rollout.max_tokens} does not fit the context of model {model!r} ({context} tokens, "
            f"{source}), which must also hold the prompt; use at most {context - 1}, well below for long prompts"
        ]
    if rollout.max_prompt_tokens is not None and rollout.max_prompt_tokens + rollout.max_tokens > context:
        return [
            f"rollout.max_prompt_tokens: {rollout.max_prompt_tokens} prompt tokens and rollout.max_tokens: "
            f"{rollout.max_tokens} response tokens do not fit the context of model {model!r} ({context} tokens, {source}); "
            f"lower them to {context} together, e.g. rollout.max_prompt_tokens={context - rollout.max_tokens}"
        ]
    return []
