"""Bridge Tinker-shaped datums and loss names to the registered policy losses.

The loss *math* lives in one place, the losses registered under
``nexrl_core.plugins.registry`` (``cross_entropy``, ``importance_sampling``, ``ppo``, ``cispo``,
``gspo``, ``dro`` from nexrl-grpo, or any plugin's). This module only translates:

* a loss name plus Tinker's ``loss_fn_config`` → the loss's attrs config, with
  aggregation ``token-sum`` (Tinker losses are sums over tokens) and Tinker's ratio
  bounds ``clip_low_threshold``/``clip_high_threshold`` turned into the config's
  ``clip_low = 1 - low`` / ``clip_high = high - 1``. Absent bounds keep the config's
  defaults: 0.2/0.2 for ``ppo`` and ``cispo`` (Tinker's 0.8/1.2), the GSPO paper's
  3e-4/4e-4 for ``gspo``;
* datums → padded [B, T] tensors and a `PolicyLossInputs`. The loss mask is the
  datum's ``weights`` (cross-entropy), else its ``sequence_ratio_mask`` or ``mask``,
  else, for a datum with ``advantages``, 1 where the advantage is non-zero, else 1 on
  every real target position. Tinker's RL losses sum over all positions and rely on
  advantages being 0 where nothing should be learnt, so a position with advantage 0
  adds nothing to the ``importance_sampling``, ``ppo`` or ``cispo`` loss either way;
  but the token-weighted metrics (``approx_kl``, ``ratio/*``, ``clip_frac``) would
  average over the prompt, where a Tinker datum's sampler logprobs are 0 (an
  on-policy step would report approx_kl ~6), and ``gspo``'s sequence ratio would
  include the prompt too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from nexrl_core.training.algorithms import PolicyLossInputs, StepTotals
from nexrl_engine.types import Datum

__all__ = [
    "ADDITIVE_METRICS",
    "DATUM_KEYS",
    "additive_reduction",
    "at_least_float32",
    "LossFn",
    "PaddedBatch",
    "UNSERVED_LOSSES",
    "build_loss_fn",
    "check_datums",
    "collate",
    "loss_mask_row",
    "split_microbatches",
    "step_totals",
    "target_logprobs",
]

TINKER_AGGREGATION = "token-sum"

DATUM_KEYS: Mapping[str, str] = {
    "target_tokens": "the token each input position predicts (always required)",
    "weights": "per-token signed loss weights (cross_entropy: -sum w * logp); also the loss mask when given",
    "logprobs": "the sampler's logprobs (losses that need old_logprobs)",
    "advantages": "per-token advantages (RL losses); without a mask key, the positions where it is non-zero are the loss mask",
    "ref_logprobs": "reference-model logprobs (losses that need ref_logprobs)",
    "sequence_ratio_mask": "positions that count (gspo's sequence ratio); used as the loss mask",
    "mask": "positions that count; used as the loss mask when no weights are given",
}
"""Accepted ``loss_fn_inputs`` keys and what each means."""

_MASK_KEYS = ("weights", "sequence_ratio_mask", "mask")
_THRESHOLD_KEYS = {"clip_low_threshold": "clip_low", "clip_high_threshold": "clip_high"}


ADDITIVE_METRICS = frozenset({"loss", "entropy"})
"""Loss metrics that, computed against the step's totals, add up over its parts."""


def additive_reduction(loss_fn: LossFn) -> str:
    """How a loss's additive metrics are named: ``sum`` under ``token-sum`` (or a loss
    without an aggregation), ``mean`` under the mean modes."""
    mode = getattr(loss_fn.config, "agg_mode", None)
    mode = getattr(mode, "value", mode)
    return "sum" if mode in (None, TINKER_AGGREGATION) else "mean"


@attrs.frozen
class LossFn:
    """A built loss with what it needs from each datum."""

    name: str
    loss: Any
    config: Any
    requires: frozenset[str]
    needs_entropy: bool


UNSERVED_LOSSES: Mapping[str, str] = {
    "stable_reinforce": (
        "Tinker has not published the StableReinforce objective (it trains on stability "
        "information that hosted Tinker's samplers record, in a form it does not document), so "
        "this service cannot compute it; train with 'ppo', 'cispo' or 'dro' instead (the "
        "cookbook's AsyncConfig(loss_fn='ppo'), or loss_fn='ppo' in the math_rl and rubric recipes)"
    ),
}
"""Tinker loss names this service refuses, each with the reason the client is shown."""


def _unknown_loss(name: str, exc: Exception) -> ValueError:
    return ValueError(f"unknown loss_fn {name!r}: {exc}")


def build_loss_fn(name: str, loss_fn_config: Mapping[str, Any] | None = None) -> LossFn:
    """Look the loss up by name in the registry and build it for Tinker semantics.

    ``loss_fn_config`` may hold Tinker's two threshold keys and any field of the loss's
    config class (e.g. ``agg_mode`` to override the ``token-sum`` default, or
    ``entropy_coeff``); anything else is rejected with the valid keys listed.
    """
    from nexrl_core.plugins.registry import RegistryError, find_spec

    if not isinstance(name, str) or not name:
        raise ValueError(f"loss_fn must be a non-empty string, got {name!r}")
    if name in UNSERVED_LOSSES:
        raise ValueError(f"loss_fn {name!r} is not served here: {UNSERVED_LOSSES[name]}")
    try:
        spec = find_spec("policy_losses", name)
    except (RegistryError, LookupError) as exc:
        raise _unknown_loss(name, exc) from exc
    config_class = spec.config_class
    fields = attrs.fields_dict(config_class) if attrs.has(config_class) else {}
    kwargs: dict[str, Any] = {}
    if "agg_mode" in fields:
        kwargs["agg_mode"] = TINKER_AGGREGATION
    given = dict(loss_fn_config or {})
    unknown = [key for key in given if key not in fields and key not in _THRESHOLD_KEYS]
    valid = sorted(set(fields) | (set(_THRESHOLD_KEYS) if {"clip_low", "clip_high"} <= set(fields) else set()))
    if unknown:
        raise ValueError(
            f"loss_fn_config keys {sorted(unknown)} are not options of loss_fn {name!r}; valid keys: {', '.join(valid) or 'none'}"
        )
    for key, value in given.items():
        if key in _THRESHOLD_KEYS:
            field = _THRESHOLD_KEYS[key]
            if field not in fields:
                raise ValueError(f"loss_fn {name!r} has no clipping, so {key!r} does not apply; valid keys: {', '.join(valid) or 'none'}")
            try:
                threshold = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"loss_fn_config[{key!r}] must be a number, got {value!r}") from None
            if not math.isfinite(threshold):
                raise ValueError(f"loss_fn_config[{key!r}] must be finite, got {value!r}")
            kwargs[field] = 1.0 - threshold if field == "clip_low" else threshold - 1.0
        else:
            kwargs[key] = value
    try:
        config = config_class(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad loss_fn_config for {name!r}: {exc}") from exc
    loss = spec.build(config)
    requires = frozenset(getattr(loss, "requires", frozenset()))
    needs_entropy = "entropy" in requires or float(getattr(config, "entropy_coeff", 0.0) or 0.0) > 0
    return LossFn(name=name, loss=loss, config=config, requires=requires, needs_entropy=needs_entropy)


def _as_list(value: Any) -> list:
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError
    return list(value)


@attrs.frozen
class CheckedDatum:
    """A datum whose inputs are validated lists of equal length."""

    input_tokens: list[int]
    values: dict[str, list]


def check_datums(datums: Sequence[Datum | Mapping[str, Any]], loss_fn: LossFn, vocab_size: int) -> list[CheckedDatum]:
    """Validate every datum against the loss, naming the datum and key that is wrong."""
    if isinstance(datums, (str, bytes)) or not isinstance(datums, Sequence) or len(datums) == 0:
        raise ValueError("datums must be a non-empty list of Datum records")
    needed = {"target_tokens"}
    if "old_logprobs" in loss_fn.requires:
        needed.add("logprobs")
    if "advantages" in loss_fn.requires:
        needed.add("advantages")
    if "ref_logprobs" in loss_fn.requires:
        needed.add("ref_logprobs")
    checked = []
    for index, datum in enumerate(datums):
        if isinstance(datum, Mapping):
            try:
                datum = Datum(input_tokens=datum["input_tokens"], loss_fn_inputs=datum["loss_fn_inputs"])
            except KeyError as exc:
                raise ValueError(f"datum {index} has no {exc.args[0]!r}") from None
        if not isinstance(datum, Datum):
            raise ValueError(f"datum {index} must be a Datum, got {type(datum).__name__}")
        try:
            tokens = [int(token) for token in _as_list(datum.input_tokens)]
        except (TypeError, ValueError):
            raise ValueError(f"datum {index}: input_tokens must be a list of token ids") from None
        if not tokens:
            raise ValueError(f"datum {index}: input_tokens is empty")
        inputs = dict(datum.loss_fn_inputs)
        unknown = sorted(set(inputs) - set(DATUM_KEYS))
        if unknown:
            raise ValueError(f"datum {index}: unknown loss_fn_inputs keys {unknown}; valid keys: {', '.join(DATUM_KEYS)}")
        missing = sorted(needed - set(inputs))
        if missing:
            raise ValueError(f"datum {index}: loss_fn {loss_fn.name!r} needs loss_fn_inputs {missing}")
        values: dict[str, list] = {}
        for key, raw in inputs.items():
            try:
                values[key] = _as_list(raw)
            except TypeError:
                raise ValueError(f"datum {index}: loss_fn_inputs[{key!r}] must be a list or tensor") from None
            if len(values[key]) != len(tokens):
                raise ValueError(
                    f"datum {index}: loss_fn_inputs[{key!r}] has {len(values[key])} values but input_tokens has "
                    f"{len(tokens)}; each position i of the input needs one value"
                )
        bad_tokens = [t for t in tokens + [int(t) for t in values["target_tokens"]] if not 0 <= t < vocab_size]
        if bad_tokens:
            raise ValueError(f"datum {index}: token ids {sorted(set(bad_tokens))[:5]} are outside the vocabulary [0, {vocab_size})")
        values["target_tokens"] = [int(t) for t in values["target_tokens"]]
        checked.append(CheckedDatum(tokens, values))
    return checked


def split_microbatches(datums: Sequence[CheckedDatum], max_tokens: int | None, max_rows: int | None = None) -> list[list[int]]:
    """Consecutive datum indices grouped so that rows x longest row (the padded tokens of
    a pass) <= ``max_tokens`` and rows <= ``max_rows``, each limit applying where it is
    not None (at least one datum per group)."""
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index, datum in enumerate(datums):
        length = len(datum.input_tokens)
        too_many_tokens = max_tokens is not None and max(longest, length) * (len(current) + 1) > max_tokens
        too_many_rows = max_rows is not None and len(current) + 1 > max_rows
        if current and (too_many_tokens or too_many_rows):
            groups.append(current)
            current, longest = [], 0
        current.append(index)
        longest = max(longest, length)
    if current:
        groups.append(current)
    return groups


@attrs.frozen
class PaddedBatch:
    """Right-padded [B, T] tensors of a chunk of datums."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    old_logprobs: torch.Tensor | None
    advantages: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    lengths: list[int]


def _padded(rows: Sequence[Sequence[Any]], width: int, fill: float, dtype: torch.dtype) -> torch.Tensor:
    """[len(rows), width] tensor of right-padded rows, built with one ``torch.tensor`` call."""
    return torch.tensor([list(row) + [fill] * (width - len(row)) for row in rows], dtype=dtype)


def loss_mask_row(datum: CheckedDatum) -> list[float]:
    """The datum's loss mask: its mask key, else where its advantage is non-zero (see the
    module docstring), else every position."""
    mask_key = next((key for key in _MASK_KEYS if key in datum.values), None)
    if mask_key is not None:
        return [float(value) for value in datum.values[mask_key]]
    if "advantages" in datum.values:
        return [float(float(value) != 0.0) for value in datum.values["advantages"]]
    return [1.0] * len(datum.input_tokens)


def step_totals(datums: Sequence[CheckedDatum]) -> StepTotals:
    """The divisors of a step made of ``datums``, known before any part of it is run, so
    that every micro-batch's loss is its share of the whole step's (`StepTotals`)."""
    magnitudes = [[abs(weight) for weight in loss_mask_row(datum)] for datum in datums]
    return StepTotals(
        tokens=float(sum(sum(row) for row in magnitudes)),
        sequences=float(sum(1 for row in magnitudes if sum(row) > 0)),
        columns=max((len(datum.input_tokens) for datum in datums), default=0),
    )


def collate(datums: Sequence[CheckedDatum], pad_id: int, device: torch.device) -> PaddedBatch:
    """Right-pad a chunk; padding gets mask 0 and value 0 (never NaN) everywhere."""
    lengths = [len(d.input_tokens) for d in datums]
    width = max(lengths)
    real = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    optional: dict[str, torch.Tensor | None] = {}
    for key in ("logprobs", "advantages", "ref_logprobs"):
        present = any(key in d.values for d in datums)
        rows = [d.values.get(key, [0.0] * n) for d, n in zip(datums, lengths)]
        optional[key] = _padded(rows, width, 0.0, torch.float32) if present else None
    mask_rows = [loss_mask_row(datum) for datum in datums]
    return PaddedBatch(
        input_ids=_padded([d.input_tokens for d in datums], width, pad_id, torch.long).to(device),
        attention_mask=real.long().to(device),
        targets=_padded([d.values["target_tokens"] for d in datums], width, 0, torch.long).to(device),
        loss_mask=_padded(mask_rows, width, 0.0, torch.float32).to(device),
        old_logprobs=None if optional["logprobs"] is None else optional["logprobs"].to(device),
        advantages=None if optional["advantages"] is None else optional["advantages"].to(device),
        ref_logprobs=None if optional["ref_logprobs"] is None else optional["ref_logprobs"].to(device),
        lengths=lengths,
    )


def at_least_float32(tensor: torch.Tensor) -> torch.Tensor:
    """Softmax inputs in float32 or wider: bf16 logits lose too much, float64 keeps its precision."""
    return tensor if tensor.dtype == torch.float64 else tensor.float()


def target_logprobs(model: Any, batch: PaddedBatch, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, T] float32 log p(target | prefix) (graph kept when grad is enabled) and,
    if asked, the per-position entropy of the model distribution."""
    positions = torch.arange(batch.input_ids.shape[1], device=batch.input_ids.device)[None, :].expand_as(batch.input_ids)
    logits = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=positions,
        use_cache=False,
    ).logits
    logits = at_least_float32(logits)
    rows, width, vocab = logits.shape
    logprobs = -torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), batch.targets.reshape(-1), reduction="none").view(rows, width)
    entropy = None
    if with_entropy:
        log_p = torch.log_softmax(logits, dim=-1)
        entropy = -(log_p.exp() * log_p).sum(dim=-1)
    return logprobs, entropy


def policy_loss_inputs(
    batch: PaddedBatch, logprobs: torch.Tensor, entropy: torch.Tensor | None, totals: StepTotals | None = None
) -> PolicyLossInputs:
    """The loss's view of a collated chunk; ``totals`` when the chunk is part of a step."""
    return PolicyLossInputs(
        logprobs=logprobs,
        loss_mask=batch.loss_mask,
        old_logprobs=batch.old_logprobs,
        advantages=batch.advantages,
        entropy=entropy,
        ref_logprobs=batch.ref_logprobs,
        step_totals=totals,
    )
