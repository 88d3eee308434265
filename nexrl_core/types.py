"""The records that flow from rollout to training.

They are plain attrs classes of Python lists and numbers, not tensors, so rollout
workers, the trajectory pool and holder trainers can build and pass them on a
machine without torch; `nexrl_core.training.batch` turns them into tensors where a trainer
needs them. Each record checks its own invariants on construction, because a
misaligned mask or logprob list would otherwise surface much later as a silently
wrong gradient.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any, Literal, Union, cast, get_args

import attrs

RunId = Union[int, str]
"""Identifies one agent run within a group (an int from the dataloader, or a string)."""

FinishReason = Literal["stop", "length"]
"""Why sampling ended: the model emitted a stop token, or it hit ``max_tokens``."""


def _non_empty(instance: Any, attribute: attrs.Attribute[Any], value: Sequence[Any]) -> None:
    if len(value) == 0:
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must not be empty")


def _finite_number(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must be a finite number, got {value!r}")


def _check_equal_lengths(record: Any, names: Sequence[str]) -> None:
    """Raise when the named list fields of ``record`` differ in length, naming every length."""
    lengths = {name: len(getattr(record, name)) for name in names}
    if len(set(lengths.values())) > 1:
        listed = ", ".join(f"{name}={length}" for name, length in lengths.items())
        raise ValueError(f"{type(record).__name__}: {', '.join(names)} must have equal lengths, got {listed}")


def _binary_mask(instance: Any, attribute: attrs.Attribute[Any], value: Sequence[int]) -> None:
    if not set(value) <= {0, 1}:
        index, bad = next((i, v) for i, v in enumerate(value) if v not in (0, 1))
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must hold only 0 and 1, got {bad!r} at index {index}")


@attrs.frozen(kw_only=True)
class Trajectory:
    """One token sequence an agent run produced, with its reward: the unit of training data.

    A multi-turn run is one trajectory whose tool outputs and later user turns sit in
    ``tokens`` with loss mask 0, so only the model's own tokens are trained.
    """

    tokens: list[int] = attrs.field(validator=_non_empty)
    """Prompt and response token ids, in order."""
    loss_mask: list[int] = attrs.field(validator=_binary_mask)
    """Per token: 1 for a response token the model sampled and is trained on, 0 for
    prompt, tool and other environment tokens."""
    logprobs: list[float]
    """Per token: the sampler's logprob of the token (the behaviour policy), 0.0 at
    positions the model did not sample."""
    reward: float = attrs.field(validator=_finite_number)
    """Outcome reward of the whole run."""
    group_id: str
    """Shared by every run that answers the same prompt, so group-relative estimators
    can compare them."""
    run_id: RunId
    """Which run of the group produced this trajectory; one run may yield several."""
    task_id: str
    """Identifies the task item (the prompt's row in the dataset), for metrics and replay."""
    is_val: bool = False
    """True for validation rollouts, which are scored but never trained on."""
    extra: dict[str, Any] = attrs.field(factory=dict)
    """Free-form per-run data (e.g. the final answer) carried along for metrics and logs."""

    def __attrs_post_init__(self) -> None:
        _check_equal_lengths(self, ("tokens", "loss_mask", "logprobs"))


def _run_key(run_id: Any) -> tuple[int, Any]:
    return (0, run_id) if isinstance(run_id, int) else (1, str(run_id))


def sort_trajectories(trajectories: Sequence[Trajectory]) -> list[Trajectory]:
    """A fixed order whatever order rollouts finished in: by group, run, then position in the
    run, so a step trains on the same rows in the same order on every backend and on resume."""
    return sorted(
        trajectories,
        key=lambda t: (t.group_id, _run_key(t.run_id), t.extra.get("trajectory_index", 0), t.task_id),
    )


@attrs.frozen(kw_only=True)
class RemoteDatum:
    """One training example in the shape remote training APIs (Tinker, Weaver) consume.

    Position ``i`` asks the model to predict ``target_tokens[i]`` after reading
    ``input_tokens[: i + 1]``, so every per-token list is aligned with the targets.
    """

    input_tokens: list[int]
    """The sequence without its last token: what the model reads."""
    target_tokens: list[int]
    """The sequence without its first token: what the model predicts at each position."""
    sampling_logprobs: list[float]
    """Sampler logprob of each target token (0.0 where the target was not sampled)."""
    advantages: list[float]
    """Advantage of each target token (0.0 where it is not trained)."""
    loss_mask: list[float]
    """Weight of each target token in the loss: 1.0 trained, 0.0 ignored."""

    def __attrs_post_init__(self) -> None:
        _check_equal_lengths(self, ("input_tokens", "target_tokens", "sampling_logprobs", "advantages", "loss_mask"))

    @classmethod
    def from_trajectory(cls, trajectory: Trajectory, advantage: float | Sequence[float]) -> RemoteDatum:
        """Shift ``trajectory`` by one token into input/target form.

        :param advantage: one advantage for the whole run, placed on every trained
            token, or a per-token list aligned with ``trajectory.tokens``.
        """
        tokens = trajectory.tokens
        if len(tokens) < 2:
            raise ValueError(f"a remote datum needs at least 2 tokens (one to read, one to predict), got {len(tokens)}")
        weights = [float(flag) for flag in trajectory.loss_mask[1:]]
        if isinstance(advantage, numbers.Real):
            advantages = [float(advantage) * weight for weight in weights]
        else:
            per_token = cast("Sequence[float]", advantage)  # numbers.Real does not narrow for a type checker
            if len(per_token) != len(tokens):
                raise ValueError(f"per-token advantages must align with the trajectory's {len(tokens)} tokens, got {len(per_token)}")
            advantages = [float(value) for value in per_token[1:]]
        return cls(
            input_tokens=list(tokens[:-1]),
            target_tokens=list(tokens[1:]),
            sampling_logprobs=[float(value) for value in trajectory.logprobs[1:]],
            advantages=advantages,
            loss_mask=weights,
        )

    @property
    def all_advantages_zero(self) -> bool:
        """True when the datum cannot move the policy, so a trainer may skip sending it."""
        return all(value == 0.0 for value in self.advantages)


def _is_openai_tool_call(call: Any) -> bool:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return False
    function = call["function"]
    return (
        isinstance(call.get("id"), str)
        and call.get("type") == "function"
        and isinstance(function.get("name"), str)
        and isinstance(function.get("arguments"), str)
    )


def _openai_tool_calls(instance: Any, attribute: attrs.Attribute[Any], value: list[dict[str, Any]]) -> None:
    for index, call in enumerate(value):
        if not _is_openai_tool_call(call):
            raise ValueError(
                f"{type(instance).__name__}.{attribute.name}[{index}] must look like "
                '{"id": str, "type": "function", "function": {"name": str, "arguments": str}}, '
                f"got {call!r}"
            )


def _finish_reason(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    valid = get_args(FinishReason)
    if value not in valid:
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must be one of {valid}, got {value!r}")


@attrs.frozen(kw_only=True)
class SampleResult:
    """One completion from a sampler, with the token ids and logprobs training needs.

    An OpenAI-style client returns text and tool calls; RL also needs the exact tokens
    that were sampled and their logprobs, so the agent's trajectory can be trained
    without re-tokenising text (which may not round-trip).
    """

    prompt_tokens: list[int]
    """Token ids the sampler was given, after the chat template."""
    response_tokens: list[int]
    """Token ids the sampler produced."""
    response_logprobs: list[float]
    """Sampler logprob of each response token."""
    response_text: str
    """The decoded response (tool-call markup removed when the parser extracted calls)."""
    tool_calls: list[dict[str, Any]] = attrs.field(factory=list, validator=_openai_tool_calls)
    """Tool calls parsed from the response, in OpenAI format:
    ``{"id", "type": "function", "function": {"name", "arguments"}}`` with ``arguments``
    a JSON string."""
    finish_reason: FinishReason = attrs.field(validator=_finish_reason)
    """``"stop"`` when the model ended the turn, ``"length"`` when ``max_tokens`` cut it."""

    def __attrs_post_init__(self) -> None:
        _check_equal_lengths(self, ("response_tokens", "response_logprobs"))
