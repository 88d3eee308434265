"""Records the engine takes and returns, shaped like Tinker's so a service can map them 1:1.

Token sequences are plain ``list[int]`` and per-token values plain ``list[float]``:
the callers (a JSON/protobuf service, a trainer) never need torch to build or read them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Union

import attrs

if TYPE_CHECKING:
    from nexrl_core.chat.model import SamplingOptions

__all__ = [
    "Datum",
    "DatumOutput",
    "ForwardResult",
    "LogprobRequest",
    "OptimStepResult",
    "PromptSamples",
    "PromptTargets",
    "SampledSequence",
    "SamplingParams",
    "StopReason",
    "TopLogprobs",
]

StopReason = Literal["stop", "length"]
TokenValues = Union[Sequence[float], Sequence[int], Any]
"""A per-token sequence: a list, or anything with ``tolist()`` (a torch tensor, numpy array)."""
TokenIds = Union[Sequence[int], Any]
"""Token ids: a list, or an integer array with ``tolist()`` (the Tinker service passes int64 numpy arrays)."""


def _finite_number(instance: Any, attribute: attrs.Attribute, value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must be a finite number, got {value!r}")
    return True


def _stop_converter(value: Any) -> tuple[str, ...] | tuple[int, ...] | None:
    """Normalise ``stop``: None stays None (stop at EOS), a string becomes a 1-tuple, a
    list becomes a tuple of all strings or all token ids (a mix is rejected)."""
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    try:
        items = tuple(value)
    except TypeError:
        raise ValueError(f"stop must be None, a string, a list of strings or a list of token ids, got {value!r}") from None
    if all(isinstance(item, str) for item in items):
        if any(item == "" for item in items):
            raise ValueError("stop strings must not be empty")
        return items
    if all(isinstance(item, int) and not isinstance(item, bool) for item in items):
        return items
    raise ValueError(f"stop must be all strings or all token ids, not a mix, got {value!r}")


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How to sample, with Tinker's semantics.

    * ``temperature`` 0 means greedy decoding; ``top_k`` -1 (or 0) and ``top_p`` 1 turn
      those filters off. Filters shape which token is *drawn*; the logprobs reported
      are always those of the raw model distribution (temperature 1, unfiltered), which
      is what an importance ratio against the training forward pass needs.
    * ``stop``: None stops at the model's EOS tokens; ``[]`` never stops early (not
      even at EOS); a list of token ids or of strings stops right after the token that
      completes one of them, and that token is kept in the output. A list of strings
      stops at EOS too (as hosted Tinker does); a list of token ids replaces the EOS
      default (a renderer lists its end tokens itself).
    * ``seed``: the same seed, prompts and params give the same samples. Each sample
      draws from its own generator, so a sample does not change when other prompts are
      batched with it, and sample j of seed s is the only sample of seed s + j (so
      single-sample requests with consecutive seeds can be merged into one).
    """

    max_tokens: int | None = attrs.field(default=None)
    """New tokens per sample; None = up to the model's context length. A sample that
    reaches the context length ends with ``stop_reason == "length"``."""
    temperature: float = attrs.field(default=1.0, validator=_finite_number)
    top_p: float = attrs.field(default=1.0, validator=_finite_number)
    top_k: int = attrs.field(default=-1)
    stop: tuple[str, ...] | tuple[int, ...] | None = attrs.field(default=None, converter=_stop_converter)
    seed: int | None = attrs.field(default=None)

    @classmethod
    def from_options(cls, options: SamplingOptions, default_stop: Sequence[str] | Sequence[int]) -> SamplingParams:
        """A chat model's `SamplingOptions` as engine parameters (without the seed, which
        the engine takes per request); no stop means ``default_stop``, the chat
        template's end-of-turn markers, never the engine's EOS-only default."""
        stop = options.stop if options.stop is not None else default_stop
        return cls(max_tokens=options.max_tokens, temperature=options.temperature, top_p=options.top_p, top_k=options.top_k, stop=stop)

    def __attrs_post_init__(self) -> None:
        if self.max_tokens is not None and (
            isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise ValueError(f"SamplingParams.max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be an integer >= -1 (-1 or 0 = off), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"SamplingParams.seed must be an integer or None, got {self.seed!r}")


@attrs.frozen
class TopLogprobs:
    """The most likely next tokens at each of a run of positions, most likely first, with
    their logprobs under the raw model distribution (temperature 1, unfiltered: the
    distribution of every other logprob the engine reports), so a teacher's top-k can
    be compared with, or renormalised against, the prompt's own logprobs."""

    token_ids: list[list[int]]
    """[positions][k]"""
    logprobs: list[list[float]]
    """[positions][k], descending along each row."""


@attrs.frozen
class PromptTargets:
    """Token ids to score inside a prompt: cell i asks for
    log p(``token_ids[i]`` | ``prompt[:positions[i]]``), the logprob of ``token_ids[i]``
    standing at prompt position ``positions[i]`` (1 to len(prompt) - 1; position 0 has
    no context). Cells, rather than a [positions, K] matrix, so that a request naming a
    few ids at a few positions (a decision's labels at its answer position) costs what
    it names."""

    positions: list[int]
    token_ids: list[int]


@attrs.frozen(kw_only=True)
class LogprobRequest:
    """Logprobs one prompt's sample call reports besides each sampled token's own
    (Tinker's ``SampleRequest`` fields of these names). They come from the same prefill
    and decode steps as the samples, under the raw model distribution."""

    topk_prompt_logprobs: int = 0
    """The k most likely tokens at every prompt position after the first (0: none)."""
    target_prompt_logprobs: PromptTargets | None = None
    topk_sample_logprobs: int = 0
    """The k most likely tokens at every sampled position (0: none)."""

    @property
    def scores_prompt(self) -> bool:
        """Whether the prefill must keep every position's logits for this prompt."""
        return self.topk_prompt_logprobs > 0 or self.target_prompt_logprobs is not None


@attrs.frozen
class SampledSequence:
    """One sample: the new tokens, their raw-model logprobs and why it ended."""

    tokens: list[int]
    """Generated tokens, including the stop token (or the tokens that completed a stop
    string) when ``stop_reason == "stop"``."""
    logprobs: list[float]
    """log p(token) under the unprocessed model distribution, one per token."""
    stop_reason: StopReason
    topk_logprobs: TopLogprobs | None = None
    """When requested (``LogprobRequest.topk_sample_logprobs``): one row per token, the
    most likely tokens at the step that drew it."""


@attrs.frozen
class PromptSamples:
    """Every sample of one prompt."""

    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    """When requested: None at position 0, then log p(prompt[t] | prompt[:t])."""
    topk_prompt_logprobs: TopLogprobs | None = None
    """When requested: row t for prompt position t + 1 (len(prompt) - 1 rows)."""
    target_prompt_logprobs: list[float] | None = None
    """When requested: one logprob per `PromptTargets` cell, in its order."""


@attrs.frozen(kw_only=True)
class Datum:
    """One training example, Tinker-shaped: position i of ``input_tokens`` predicts
    ``loss_fn_inputs["target_tokens"][i]``.

    ``loss_fn_inputs`` keys: ``target_tokens`` (always), ``weights`` (per-token loss
    weights; ``cross_entropy``), ``logprobs`` (the sampler's) and ``advantages`` (the RL
    losses), optionally ``sequence_ratio_mask`` / ``mask`` (which positions count) and
    ``ref_logprobs``. Every value has one entry per input token.
    """

    input_tokens: TokenIds
    loss_fn_inputs: Mapping[str, TokenValues]


@attrs.frozen
class DatumOutput:
    """Per-datum output of forward/forward_backward."""

    logprobs: list[float]
    """log p(target_tokens[i] | input_tokens[:i+1]) under the current weights, before
    the update."""


@attrs.frozen
class ForwardResult:
    """What forward/forward_backward return.

    ``metrics`` keys follow Tinker's ``name:reduction`` rule: ``loss:sum`` is the total
    loss (Tinker losses are sums), the loss's own metrics are reduced as ``:mean``
    (token-weighted across micro-batches), ``:min`` or ``:max``, plus ``num_tokens:sum``
    and ``num_sequences:sum``.
    """

    outputs: list[DatumOutput]
    metrics: dict[str, float]
    loss_fn: str


@attrs.frozen
class OptimStepResult:
    """Outcome of one optimizer step."""

    grad_norm: float
    """Global L2 norm of the accumulated gradients before clipping (inf/nan if they were)."""
    learning_rate: float
    step: int
    """Optimizer steps taken so far (a skipped step does not count)."""
    skipped: bool
    """True when the gradient norm was not finite: weights unchanged, gradients dropped."""
    clipped: bool

    @property
    def metrics(self) -> dict[str, float]:
        return {
            "grad_norm": self.grad_norm,
            "lr": self.learning_rate,
            "step": float(self.step),
            "skipped": float(self.skipped),
            "clipped": float(self.clipped),
        }
