"""The decode loop behind `nexrl_engine.sampling.sample_batch`, kept on the device.

Per token, nothing leaves the device: the sampled ids, their raw logprobs, the stop-token
test, the finished flags and each row's length go into preallocated tensors, and the
host looks at them only every ``sync_every`` tokens (the `DecodePolicy`). There it
checks stop strings on the tokens of that stretch (exactly the per-token rule, see
`StringStops`), collects rows that ended, and drops them from the batch once enough of
them have (a finished row that stays computes garbage nobody reads, which is cheaper
than re-selecting the cache at every row's end).

On CUDA the key/value cache is a preallocated ``transformers.StaticCache`` (grown by
doubling when a long generation needs more room) and one decode step (forward pass of
the last tokens, draw, bookkeeping) is captured once as a CUDA graph and replayed, so a
token costs one launch. On CPU the loop runs eagerly on a dynamic cache, syncing every
token (a sync is free there) so that no step is spent on a batch that has ended.
Whatever the path, every row's tokens, logprobs and stop reasons are those of the
plain per-token algorithm (see the tests' reference implementation).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from nexrl_engine.types import TopLogprobs

__all__ = ["DecodePolicy", "RowDraws", "RowResult", "StringStops", "choose_tokens", "decode_rows", "default_policy"]

COUNTERS: collections.Counter[str] = collections.Counter()
"""What the loop did since import (``eager_steps``, ``graph_captures``, ``graph_replays``,
``compactions``, ``cache_growths``, ``static_calls``, ``dynamic_calls``): for benchmarks
and tests to see which path ran."""


@attrs.frozen
class DecodePolicy:
    """How the decode loop runs; results do not depend on it (up to float rounding of
    batched matrix products)."""

    sync_every: int = 1
    """Tokens between host checks (finished rows, stop strings, compaction)."""
    compact_at: float = 0.0
    """Drop finished rows from the batch once at least this fraction of it has finished
    (0: as soon as one has)."""
    static_cache: bool = False
    """Preallocated key/value cache (transformers ``StaticCache``) where the model allows."""
    cuda_graphs: bool = False
    """Capture the decode step as a CUDA graph (needs ``static_cache`` and a CUDA device)."""
    static_chunk: int = 256
    """New-token room a static cache starts with; it doubles when a row needs more."""
    math_attention: bool = False
    """Decode steps on a static cache use sdpa's math backend (with one query per row, the
    memory-efficient kernel CUDA would pick wastes most of its 64-query tiles)."""

    def __attrs_post_init__(self) -> None:
        if self.sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {self.sync_every}")
        if not 0.0 <= self.compact_at <= 1.0:
            raise ValueError(f"compact_at must be in [0, 1], got {self.compact_at}")


def default_policy(device: torch.device) -> DecodePolicy:
    """CUDA: static cache, CUDA graphs, sdpa's math backend, a host check every 8 tokens,
    compaction once half the batch has ended. Anything else: eager, dynamic cache, a
    check every token, a row dropped as soon as it ends: there a sync costs nothing (the
    host is the device), and copying the cache's other rows costs less than one more
    step of the row."""
    if device.type == "cuda":
        return DecodePolicy(sync_every=8, compact_at=0.5, static_cache=True, cuda_graphs=True, math_attention=True)
    return DecodePolicy(sync_every=1, compact_at=0.0)


@attrs.frozen
class RowResult:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str
    topk: TopLogprobs | None = None


# --- drawing tokens ------------------------------------------------------------------------------


@attrs.frozen
class RowDraws:
    """Each row's own temperature, top-k and top-p, as device tensors: a batch whose rows
    came from requests that sample differently (a service's concurrent requests) still
    decodes in one loop, and each row draws exactly what it would draw in a batch of
    its own kind. The flags say which filters any row uses, so a batch skips the rest."""

    greedy: torch.Tensor
    """[rows] bool: temperature 0, argmax."""
    divisor: torch.Tensor
    """[rows] float64: the temperature (1 for greedy rows, whose scores are unused)."""
    top_k: torch.Tensor
    """[rows] long: how many top scores stay; the vocabulary size where top-k is off."""
    top_p: torch.Tensor
    """[rows] float64."""
    nucleus: torch.Tensor
    """[rows] bool: top-p below 1 (on)."""
    any_greedy: bool
    any_top_k: bool
    any_top_p: bool

    @classmethod
    def of(cls, params: Sequence[Any], vocab: int, device: torch.device) -> RowDraws:
        """One row per entry of ``params`` (`SamplingParams`-like)."""
        greedy = [p.temperature == 0 for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        nucleus = [p.top_p < 1.0 for p in params]
        return cls(
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            divisor=torch.tensor([1.0 if g else float(p.temperature) for g, p in zip(greedy, params)], dtype=torch.float64, device=device),
            top_k=torch.tensor(top_k, dtype=torch.long, device=device),
            top_p=torch.tensor([float(p.top_p) for p in params], dtype=torch.float64, device=device),
            nucleus=torch.tensor(nucleus, dtype=torch.bool, device=device),
            any_greedy=any(greedy),
            any_top_k=any(k < vocab for k, g in zip(top_k, greedy) if not g),
            any_top_p=any(n for n, g in zip(nucleus, greedy) if not g),
        )

    def select(self, index: torch.Tensor) -> RowDraws:
        """The rows at ``index`` (the decoder drops finished rows); the flags stay, so a
        captured step keeps its shape of work."""
        picked = {name: getattr(self, name).index_select(0, index) for name in ("greedy", "divisor", "top_k", "top_p", "nucleus")}
        return attrs.evolve(self, **picked)


def _choose_per_row(logits: torch.Tensor, draws: RowDraws, uniforms: torch.Tensor | None) -> torch.Tensor:
    """`choose_tokens` with each row's own settings: per row the same operations on the
    same values as a batch of that row's settings alone (the k-th score read from a sort
    rather than ``topk`` is the same number), so the same token."""
    assert uniforms is not None
    scores = logits.double() / draws.divisor[:, None]
    if draws.any_top_k:
        kth = torch.sort(scores, dim=-1, descending=True).values.gather(-1, (draws.top_k - 1)[:, None])
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if draws.any_top_p:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill((mass_before >= draws.top_p[:, None]) & draws.nucleus[:, None], 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    chosen = _inverse_cdf(probs, uniforms)
    return torch.where(draws.greedy, logits.argmax(dim=-1), chosen) if draws.any_greedy else chosen


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The token each row's uniform picks from its distribution."""
    vocab = probs.shape[-1]
    cdf = probs.cumsum(dim=-1)
    targets = uniforms.to(cdf.dtype)[:, None] * cdf[:, -1:]
    chosen = torch.searchsorted(cdf, targets, right=True)[:, 0]
    # Rounding can put the target at the very end of the cdf; fall back to the mode.
    bad = (chosen >= vocab) | (probs.gather(-1, chosen.clamp(max=vocab - 1)[:, None])[:, 0] <= 0)
    if bad.device.type != "cuda" and not bool(bad.any()):
        return chosen  # on the host a check is cheaper than the argmax (it never syncs a GPU)
    return torch.where(bad, probs.argmax(dim=-1), chosen)


def choose_tokens(logits: torch.Tensor, params: Any, uniforms: torch.Tensor | None) -> torch.Tensor:
    """Draw one token per row from the temperature/top-k/top-p distribution by inverse
    CDF with the row's own uniform; temperature 0 is argmax. ``params``: one
    `SamplingParams`-like for every row, or `RowDraws`. No host sync on CUDA."""
    if isinstance(params, RowDraws):
        return _choose_per_row(logits, params, uniforms)
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    assert uniforms is not None
    scores = logits.double() / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return _inverse_cdf(probs, uniforms)


# --- stop strings --------------------------------------------------------------------------------


class StringStops:
    """The stop-string half of a `StopRule`, checked a stretch of tokens at a time.

    `first_hit` returns the first token t of a stretch at which the per-token rule
    (``decode(tokens[: t + 1][-window:])`` contains a stop string) fires. It decodes the
    stretch with its window of context once; only when a stop string (or U+FFFD, a cut
    multi-byte character) shows up there does it decode token by token. That shortcut
    relies on the decoding of a run of tokens containing the decoding of any sub-run
    (up to characters cut at the sub-run's ends, which decode as U+FFFD), as byte-level
    BPE and SentencePiece decoders do; a stop string that itself contains U+FFFD is
    always checked token by token.
    """

    def __init__(self, strings: Sequence[str], window: int, decode: Callable[[list[int]], str]) -> None:
        self.strings = tuple(strings)
        self.window = window
        self.decode = decode
        self.exact_only = any("\ufffd" in stop for stop in self.strings)

    def _hit(self, tokens: list[int]) -> bool:
        text = self.decode(tokens[-self.window :])
        return any(stop in text for stop in self.strings)

    def first_hit(self, tokens: list[int], start: int, end: int) -> int | None:
        """First t in [start, end) whose token completes a stop string, else None."""
        if start >= end:
            return None
        if not self.exact_only:
            low = 0 if self.window <= 0 else max(0, start - self.window + 1)
            text = self.decode(tokens[low:end])
            if "\ufffd" not in text and not any(stop in text for stop in self.strings):
                return None
        for t in range(start, end):
            if self._hit(tokens[: t + 1]):
                return t
        return None


# --- caches --------------------------------------------------------------------------------------


def _cache_keyword(model: Any) -> str:
    """``cache`` (newer transformers) or ``past_key_values``, as the base model's forward
    names it (a peft wrapper passes keywords through to the base model)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return _cache_keyword_of(type(base))  # type: ignore[arg-type]  # mypy finds no class object Hashable (python/mypy#11470)


@functools.cache
def _cache_keyword_of(cls: type[torch.nn.Module]) -> str:
    try:
        parameters = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in parameters else "past_key_values"


def _output_cache(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _static_ok(model: Any) -> bool:
    """A StaticCache we know how to drive: every layer full attention, sdpa or eager."""
    config = getattr(model, "config", None)
    if config is None:
        return False
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ("sdpa", "eager"):
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and any(kind != "full_attention" for kind in layer_types):
        return False
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        return False
    try:
        from transformers import StaticCache  # noqa: F401
    except ImportError:
        return False
    return True


def _math_backend() -> Callable[[], Any] | None:
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    return lambda: sdpa_kernel(SDPBackend.MATH)


def _new_static_cache(model: Any, length: int) -> Any | None:
    from transformers import StaticCache

    try:
        cache = StaticCache(config=model.config, max_cache_len=length)
    except Exception:  # noqa: BLE001 - an older transformers signature: no static cache
        return None
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer).__name__ != "StaticLayer" for layer in layers):
        return None
    return cache


def _static_layers_ready(cache: Any) -> bool:
    return all(getattr(layer, "is_initialized", False) and torch.is_tensor(getattr(layer, "keys", None)) for layer in cache.layers)


def _select_static(cache: Any, index: torch.Tensor) -> None:
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, index)
        layer.values = layer.values.index_select(0, index)
        if hasattr(layer, "batch_size"):
            layer.batch_size = int(index.numel())


def _grow_static(cache: Any, length: int) -> None:
    for layer in cache.layers:
        for name in ("keys", "values"):
            old = getattr(layer, name)
            new = old.new_zeros((*old.shape[:2], length, old.shape[3]))
            new[:, :, : old.shape[2]] = old
            setattr(layer, name, new)
        layer.max_cache_len = length


# --- the loop ------------------------------------------------------------------------------------


class _Decoder:
    """The rows still in the batch and their device-side state.

    ``step`` (a one-element device tensor) is the index of the last drawn token; every
    row in the batch drew the same number of tokens. A unit of work (`_unit`) feeds the
    last tokens, then draws the next: it touches only device tensors, in place, so it
    can be captured as a CUDA graph and replayed.
    """

    def __init__(
        self,
        *,
        model: Any,
        cache: Any,
        static: bool,
        logits: torch.Tensor,
        last_position: torch.Tensor,
        mask: torch.Tensor,
        width: int,
        uniforms: torch.Tensor | None,
        limits: list[int],
        params: Any,
        stop_ids: Sequence[Sequence[int]],
        strings: Sequence[StringStops | None],
        policy: DecodePolicy,
        max_new: int,
        topk: Sequence[int],
    ) -> None:
        device = logits.device
        if isinstance(params, list):
            params = RowDraws.of(params, logits.shape[-1], device)
        self.model, self.cache, self.static, self.params = model, cache, static, params
        self.policy, self.max_new, self.width = policy, max_new, width
        self.strings = list(strings)
        """Each slot's stop strings (None: it has none)."""
        self.any_strings = any(rule is not None for rule in self.strings)
        self.keyword = _cache_keyword(model)
        n_rows = logits.shape[0]
        self.rows = list(range(n_rows))
        """Original row of each batch slot."""
        self.logits = logits.float().contiguous()
        self.pos = last_position.clone()
        self.uniforms = uniforms
        self.limit = torch.tensor(limits, dtype=torch.long, device=device)
        self.stop_ids = _stop_id_rows(stop_ids, device)
        self.step = torch.zeros(1, dtype=torch.long, device=device)
        self.tok = torch.zeros((n_rows, 1), dtype=torch.long, device=device)
        self.tokens = torch.zeros((n_rows, max_new), dtype=torch.long, device=device)
        self.logprobs = torch.zeros((n_rows, max_new), dtype=torch.float32, device=device)
        self.finished = torch.zeros(n_rows, dtype=torch.bool, device=device)
        self.length = torch.zeros(n_rows, dtype=torch.long, device=device)
        self.stopped = torch.zeros(n_rows, dtype=torch.bool, device=device)
        self.topk = list(topk)
        """Each original row's top-k width (0: none)."""
        self.topk_width = max(self.topk, default=0)
        """Top-k columns every row records (the widest row's; rows keep their own on the host)."""
        self.state = ["logits", "pos", "tok", "tokens", "logprobs", "finished", "length", "stopped", "limit", "mask"]
        """Per-slot device tensors (``_compact`` selects their live rows)."""
        if self.topk_width:
            self.topk_ids = torch.zeros((n_rows, max_new, self.topk_width), dtype=torch.int32, device=device)
            self.topk_logprobs = torch.zeros((n_rows, max_new, self.topk_width), dtype=torch.float32, device=device)
            self.state += ["topk_ids", "topk_logprobs"]
        self.math: Callable[[], Any] | None = None
        """Makes the context the model runs in (sdpa's math backend), if any."""
        self.mask = mask
        self.mask_on: bool | float = True
        """What a static mask holds where a row may attend (sdpa's True, or an additive 0.0)."""
        if static:
            self._static_mask(mask)
        self.graph: Any = None
        self.graphs_ok = policy.cuda_graphs and static and device.type == "cuda"
        self.eager_units = 0
        # Host side.
        self.drawn = 0
        """Tokens drawn by every row in the batch (host mirror of ``step + 1``)."""
        self.checked = 0
        """Tokens whose stop-string test is done for every live row."""
        self.host_tokens: list[list[int]] = [[] for _ in range(n_rows)]
        self.string_end: dict[int, int] = {}
        """Slot -> length, for rows a stop string ended (not yet flushed)."""
        self.results: dict[int, RowResult] = {}

    def _static_mask(self, mask: torch.Tensor) -> None:
        """[B, 1, 1, L]: what the attention sees, built here so that the model never
        builds a mask (no host logic inside a captured step)."""
        allowed = mask.bool()[:, None, None, :]
        if self.model.config._attn_implementation == "sdpa":
            self.math = _math_backend() if self.policy.math_attention else None
            self.mask = allowed.contiguous()
        else:
            dtype = next(self.model.parameters()).dtype
            self.mask = torch.zeros(allowed.shape, dtype=dtype, device=mask.device).masked_fill_(~allowed, torch.finfo(dtype).min)
            self.mask_on = 0.0

    # -- device work --

    def _draw(self) -> None:
        step = self.step
        uniforms = self.uniforms.index_select(1, step)[:, 0] if self.uniforms is not None else None
        chosen = choose_tokens(self.logits, self.params, uniforms)
        raw = torch.log_softmax(self.logits, dim=-1)
        self.tokens.index_copy_(1, step, chosen[:, None])
        self.logprobs.index_copy_(1, step, raw.gather(-1, chosen[:, None]))
        if self.topk_width:
            top = raw.topk(self.topk_width, dim=-1)
            self.topk_logprobs.index_copy_(1, step, top.values[:, None])
            self.topk_ids.index_copy_(1, step, top.indices[:, None].to(torch.int32))
        ended = step + 1 >= self.limit
        if self.stop_ids is not None:
            hit = (chosen[:, None] == self.stop_ids).any(dim=-1)
            ended = ended | hit
            self.stopped.logical_or_(hit & ~self.finished)
        newly = ended & ~self.finished
        self.length.copy_(torch.where(newly, step + 1, self.length))
        self.finished.logical_or_(newly)
        self.tok.copy_(chosen[:, None])

    def _forward(self) -> None:
        if self.static:
            slot = self.step + self.width
            self.mask.index_fill_(3, slot, self.mask_on)
            mask = self.mask
        else:
            column = self.width + self.drawn - 1
            self.mask[:, column] = 1
            mask = self.mask[:, : column + 1]
        self.pos.add_(1)
        # (sdpa_kernel sets process-wide flags while the step runs eagerly or is recorded;
        # a replayed graph runs the kernels it recorded.)
        with self.math() if self.math is not None else contextlib.nullcontext():
            out = self.model(input_ids=self.tok, attention_mask=mask, position_ids=self.pos, use_cache=True, **{self.keyword: self.cache})
        self.logits.copy_(out.logits[:, -1])

    def _unit(self) -> None:
        self._forward()
        self.step.add_(1)
        self._draw()

    def _advance(self) -> None:
        """Feed the last tokens and draw the next ones (``drawn`` += 1)."""
        if self.graph is not None:
            self.graph.replay()
            COUNTERS["graph_replays"] += 1
        elif self.graphs_ok and self.eager_units >= 1:
            self._capture()
        else:
            self._unit()
            self.eager_units += 1
            COUNTERS["eager_steps"] += 1
        self.drawn += 1

    def _capture(self) -> None:
        """Run one unit on a side stream (the warm-up CUDA graphs need; it is a real
        step), then record the next unit. A failed capture leaves the state as the
        warm-up left it (recording runs nothing) and turns graphs off for this call."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._unit()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self._unit()
        except Exception as error:  # noqa: BLE001 - graphs are an optimisation
            self.graphs_ok = False
            _warn_once(f"CUDA graph capture of the decode step failed ({type(error).__name__}: {error}); decoding eagerly")
            return
        self.graph = graph
        COUNTERS["graph_captures"] += 1

    def _reshaped(self) -> None:
        self.graph = None
        self.eager_units = 0

    # -- host work --

    def _check_strings(self, finished: list[bool], length: list[int]) -> list[int]:
        """Stop strings over the tokens drawn since the last check; slots they end."""
        block = self.tokens[:, self.checked : self.drawn].tolist()
        ended = []
        for slot, new in enumerate(block):
            rule = self.strings[slot]
            if rule is None or slot in self.string_end:
                continue
            mine = self.host_tokens[slot]
            mine.extend(new)
            end = length[slot] if finished[slot] else self.drawn
            if end <= self.checked:
                continue
            hit = rule.first_hit(mine, self.checked, end)
            if hit is not None:
                self.string_end[slot] = hit + 1
                ended.append(slot)
        self.checked = self.drawn
        return ended

    def _sync(self) -> bool:
        """Host check; True when no row is left."""
        state = torch.stack([self.finished.long(), self.length]).tolist()
        finished, length = [bool(flag) for flag in state[0]], state[1]
        if self.any_strings:
            ended = self._check_strings(finished, length)
            if ended:
                for slot in ended:
                    finished[slot] = True
                self.finished[torch.tensor(ended, dtype=torch.long, device=self.finished.device)] = True
        live = [slot for slot, done in enumerate(finished) if not done]
        if not live:
            self._flush(list(range(len(self.rows))), length)
            return True
        dead = len(self.rows) - len(live)
        if dead and dead >= self.policy.compact_at * len(self.rows):
            self._flush([slot for slot, done in enumerate(finished) if done], length)
            self._compact(live)
        if self.static:
            self._ensure_room()
        return False

    def _flush(self, slots: list[int], length: list[int]) -> None:
        lengths = [self.string_end.get(slot, length[slot]) for slot in slots]
        index = torch.tensor(slots, dtype=torch.long, device=self.tokens.device)
        width = max(lengths)
        tokens = self.tokens.index_select(0, index)[:, :width].tolist()
        logprobs = self.logprobs.index_select(0, index)[:, :width].tolist()
        stopped = self.stopped.index_select(0, index).tolist()
        top_ids = top_logprobs = None
        if self.topk_width:
            top_ids = self.topk_ids.index_select(0, index)[:, :width].tolist()
            top_logprobs = self.topk_logprobs.index_select(0, index)[:, :width].tolist()
        for i, slot in enumerate(slots):
            row, n = self.rows[slot], lengths[i]
            reason = "stop" if slot in self.string_end or stopped[i] else "length"
            topk = None
            if top_ids is not None and top_logprobs is not None and self.topk[row]:
                k = self.topk[row]
                topk = TopLogprobs([ids[:k] for ids in top_ids[i][:n]], [values[:k] for values in top_logprobs[i][:n]])
            self.results[row] = RowResult(tokens[i][:n], logprobs[i][:n], reason, topk)

    def _compact(self, live: list[int]) -> None:
        index = torch.tensor(live, dtype=torch.long, device=self.tokens.device)
        for name in self.state:
            setattr(self, name, getattr(self, name).index_select(0, index))
        if self.uniforms is not None:
            self.uniforms = self.uniforms.index_select(0, index)
        if self.stop_ids is not None:
            self.stop_ids = self.stop_ids.index_select(0, index)
        if isinstance(self.params, RowDraws):
            self.params = self.params.select(index)
        if self.static:
            _select_static(self.cache, index)
        else:
            self.cache.batch_select_indices(index)
        self.rows = [self.rows[slot] for slot in live]
        self.host_tokens = [self.host_tokens[slot] for slot in live]
        self.strings = [self.strings[slot] for slot in live]
        self.string_end = {}
        self._reshaped()
        COUNTERS["compactions"] += 1

    def _ensure_room(self) -> None:
        """Room in the static cache for every token fed before the next check."""
        capacity = self.mask.shape[-1]
        needed = min(self.width + self.max_new, self.width + self.drawn + self.policy.sync_every)
        if needed <= capacity:
            return
        length = capacity
        while length < needed:
            length = min(self.width + self.max_new, self.width + 2 * (length - self.width))
        _grow_static(self.cache, length)
        grown = self.mask.new_zeros((*self.mask.shape[:3], length))
        if self.mask_on is not True:
            grown.fill_(torch.finfo(grown.dtype).min)
        grown[..., :capacity] = self.mask
        self.mask = grown
        self._reshaped()
        COUNTERS["cache_growths"] += 1

    def run(self) -> dict[int, RowResult]:
        self._draw()
        self.drawn = 1
        every = self.policy.sync_every
        while True:
            if self.drawn == self.max_new or self.drawn % every == 0:
                if self._sync() or self.drawn == self.max_new:
                    break
            self._advance()
        return self.results


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _stop_id_rows(stop_ids: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor | None:
    """[rows, most ids] each row's stop token ids, padded with -1 (no token); None when no
    row has any."""
    most = max((len(ids) for ids in stop_ids), default=0)
    if most == 0:
        return None
    table = torch.full((len(stop_ids), most), -1, dtype=torch.long)
    for row, ids in enumerate(stop_ids):
        table[row, : len(ids)] = torch.tensor(sorted(ids), dtype=torch.long)
    return table.to(device)


def decode_rows(
    model: Any,
    *,
    prefill: Callable[[Any | None, int], tuple[Any, torch.Tensor]],
    expand: torch.Tensor | None,
    last_position: torch.Tensor,
    mask: torch.Tensor,
    uniforms: torch.Tensor | None,
    limits: list[int],
    params: Any,
    stop_ids: Sequence[Sequence[int]],
    strings: Sequence[StringStops | None],
    policy: DecodePolicy,
    topk: Sequence[int] | None = None,
) -> list[RowResult]:
    """Decode every row until it ends; one `RowResult` per row.

    ``params`` says how every row draws (a `SamplingParams`) or each row its own way (a
    list of them, one per row); ``stop_ids`` and ``strings`` are each row's stop tokens and stop strings.
    ``topk`` (one per row; None: 0 for all) is how many of the most likely tokens each
    row records, with their raw logprobs, at every step: they are read off the same
    log-softmax as the drawn token's logprob, inside the step (a captured graph too).

    ``prefill(cache, length)`` runs the prompts through the model into ``cache`` (None:
    let the model make a dynamic one) with a ``length``-wide attention mask and returns
    the cache and the last position's logits, one row per prompt; ``expand`` (row ->
    prompt) then repeats prompts into rows. ``mask`` ([prompts, width]) and
    ``last_position`` are per prompt as well.
    """
    width = mask.shape[1]
    max_new = max(limits)
    static = policy.static_cache and _static_ok(model)
    cache = None
    if static:
        capacity = width + min(max_new, max(policy.static_chunk, policy.sync_every + 1))
        cache = _new_static_cache(model, capacity)
        static = cache is not None
    if static:
        cache, logits = prefill(cache, capacity)
        if not _static_layers_ready(cache):
            raise RuntimeError("static cache layers were not initialised by the prefill")
        full_mask = torch.cat([mask, mask.new_zeros((mask.shape[0], capacity - width))], dim=1)
    else:
        cache, logits = prefill(None, width)
        full_mask = torch.cat([mask, mask.new_zeros((mask.shape[0], max_new))], dim=1)
    if expand is not None:
        logits = logits.index_select(0, expand)
        full_mask = full_mask.index_select(0, expand)
        last_position = last_position.index_select(0, expand)
        if static:
            _select_static(cache, expand)
        else:
            cache.batch_select_indices(expand)
    decoder = _Decoder(
        model=model,
        cache=cache,
        static=static,
        logits=logits,
        last_position=last_position,
        mask=full_mask,
        width=width,
        uniforms=uniforms,
        limits=limits,
        params=params,
        stop_ids=stop_ids,
        strings=strings,
        policy=policy,
        max_new=max_new,
        topk=topk if topk is not None else [0] * len(limits),
    )
    COUNTERS["static_calls" if static else "dynamic_calls"] += 1
    results = decoder.run()
    return [results[row] for row in range(len(limits))]
