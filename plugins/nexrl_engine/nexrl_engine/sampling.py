"""Batched sampling with a KV cache, returning the raw model's logprobs.

Why a hand-written loop instead of ``generate``: the logprobs an RL loss divides by
must be those of the unprocessed model distribution (``generate``'s scores are
renormalised after top-k/top-p and min-length processing), each sample needs its own
random stream so that batching does not change results, and stop strings, stop token
ids and "no stop at all" are Tinker semantics that ``generate`` does not all have.

Layout: prompts are left-padded into one batch and prefilled once; the cache is then
repeated ``num_samples`` times per prompt; each decode step feeds one token per row
with explicit ``position_ids`` (pads do not count). Every row's random numbers are
drawn up front on the CPU, from its own generator, and moved to the device once. The
decode loop itself (`nexrl_engine.decode`) keeps tokens, logprobs, stop-token checks and
finished flags on the device and looks at them from the host only every few tokens; on
CUDA it runs on a preallocated cache with the step captured as a CUDA graph.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from nexrl_engine.decode import DecodePolicy, StringStops, _cache_keyword, _output_cache, decode_rows, default_policy
from nexrl_engine.types import LogprobRequest, PromptSamples, SampledSequence, SamplingParams, TopLogprobs

__all__ = ["StopRule", "derive_seed", "make_stop_rule", "sample_batch"]


@attrs.frozen
class StopRule:
    """When a row stops: after a token in ``token_ids``, or once the decoded text of the
    last ``window`` tokens contains one of ``strings``."""

    token_ids: frozenset[int]
    strings: tuple[str, ...]
    window: int

    def hit(self, tokens: list[int], decode: Callable[[list[int]], str]) -> bool:
        if tokens[-1] in self.token_ids:
            return True
        if self.strings:
            text = decode(tokens[-self.window :])
            return any(stop in text for stop in self.strings)
        return False


def make_stop_rule(stop: tuple[str, ...] | tuple[int, ...] | None, eos_token_ids: Sequence[int], vocab_size: int) -> StopRule:
    """Turn ``SamplingParams.stop`` into a rule (see `SamplingParams` for the semantics).

    Stop strings keep the EOS tokens as stops, as hosted Tinker does: a renderer that
    asks for ``["\\n\\nUser:"]`` still wants a sample to end where the model ends it,
    not to run on to ``max_tokens``."""
    if stop is None:
        return StopRule(frozenset(eos_token_ids), (), 0)
    if all(isinstance(item, str) for item in stop) and stop:
        # A stop string completed by the newest token ends inside that token and starts
        # at most len(bytes) - 1 bytes earlier; every token has at least one byte, so
        # decoding the last len(bytes) + 1 tokens always sees the whole occurrence.
        window = max(len(item.encode("utf-8")) for item in stop) + 1  # type: ignore[union-attr]
        return StopRule(frozenset(eos_token_ids), tuple(stop), window)  # type: ignore[arg-type]
    bad = [item for item in stop if not 0 <= int(item) < vocab_size]
    if bad:
        raise ValueError(f"stop token ids {bad} are outside the vocabulary [0, {vocab_size})")
    return StopRule(frozenset(int(item) for item in stop), (), 0)


def derive_seed(seed: int, prompt_index: int) -> int:
    """A 63-bit generator seed for one sample, stable across runs, platforms and batch
    layouts.

    Sample j of prompt i in a call seeded ``s`` uses ``derive_seed(s + j, i)``: sample j
    of a seed-``s`` request draws exactly what the only sample of a seed-``s + j``
    request draws. A client may therefore merge single-sample requests for one prompt
    with consecutive seeds into one ``num_samples`` request without changing any sample.
    """
    digest = hashlib.blake2b(f"{seed}:{prompt_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _draw_uniforms(seeds: Sequence[int], count: int) -> torch.Tensor:
    """[rows, count] uniforms in [0, 1), each row from its own generator."""
    rows = []
    generator = torch.Generator(device="cpu")
    for seed in seeds:
        generator.manual_seed(seed)
        rows.append(torch.rand(count, generator=generator, dtype=torch.float64))
    return torch.stack(rows) if rows else torch.empty(0, count, dtype=torch.float64)


def _left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(prompt) for prompt in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that skip left padding: 0 at each row's first real token."""
    return (mask.cumsum(dim=-1) - 1).clamp(min=0)


@torch.inference_mode()
def sample_batch(
    model: Any,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    *,
    num_samples: int | Sequence[int],
    stop_rule: StopRule | Sequence[StopRule],
    pad_id: int,
    max_positions: int,
    decode: Callable[[list[int]], str],
    base_seed: int,
    prompt_seeds: Sequence[int | None] | None = None,
    include_prompt_logprobs: bool = False,
    logprobs: LogprobRequest | Sequence[LogprobRequest | None] | None = None,
    policy: DecodePolicy | None = None,
) -> list[PromptSamples]:
    """Sample ``num_samples`` continuations of every prompt (one count for all, or one per
    prompt); one `PromptSamples` per prompt.

    ``params`` and ``stop_rule`` hold for every prompt, or each is a sequence with one per
    prompt: prompts that sample differently (temperature, top-k, top-p, max_tokens,
    stop) share one decode loop, and each gets what it would get in a call of its own
    (its own seed given, as below).

    Sample j of prompt i draws its random numbers from ``derive_seed(prompt_seeds[i] + j,
    0)`` when the prompt has its own seed, else from ``derive_seed(base_seed + j, i)``. A
    prompt with its own seed thus draws exactly the numbers it would draw alone in a
    call with ``base_seed`` = that seed, whatever else shares the batch: it gets the same
    tokens, and logprobs equal up to float rounding (~1e-5 at most; CPU matrix kernels
    round a row differently depending on the batch size and the row's place in it, and
    a left-padded row attends over more key slots).

    ``logprobs`` asks for top-k and target logprobs (`LogprobRequest`), for every prompt
    or one per prompt (None: none); they are computed in the same prefill and decode
    steps, so they are of exactly the distribution the samples' logprobs are.

    ``policy`` says how the decode loop runs (`nexrl_engine.decode.default_policy` for the
    model's device when None); it changes speed, never results. Should a static cache or
    CUDA graph path fail, the call is redone on the plain path (with a warning).

    Inputs are assumed validated (non-empty prompts of in-vocabulary ids).
    """
    device = next(model.parameters()).device
    if policy is None:
        policy = default_policy(device)
    requests = [r or LogprobRequest() for r in _per_prompt(logprobs, (LogprobRequest, type(None)), len(prompts), "logprobs")]
    try:
        return _sample_batch(
            model, prompts, params, num_samples, stop_rule, pad_id, max_positions, decode, base_seed, prompt_seeds,
            include_prompt_logprobs, requests, policy,
        )  # fmt: skip
    except Exception as error:  # noqa: BLE001 - retried on the plain path, which raises for real
        if not (policy.static_cache or policy.cuda_graphs):
            raise
        plain = attrs.evolve(policy, static_cache=False, cuda_graphs=False)
        _warn_fallback(error)
        return _sample_batch(
            model, prompts, params, num_samples, stop_rule, pad_id, max_positions, decode, base_seed, prompt_seeds,
            include_prompt_logprobs, requests, plain,
        )  # fmt: skip


def _warn_fallback(error: Exception) -> None:
    import warnings

    warnings.warn(
        f"static-cache sampling failed ({type(error).__name__}: {error}); sampled on the dynamic cache instead",
        RuntimeWarning,
        stacklevel=3,
    )


def _per_prompt(value: Any, kind: type | tuple[type, ...], n_prompts: int, name: str) -> list[Any]:
    """``value`` for every prompt, or its one entry per prompt."""
    if isinstance(value, kind):
        return [value] * n_prompts
    values = list(value)
    if len(values) != n_prompts:
        raise ValueError(f"{name} has {len(values)} entries for {n_prompts} prompts; give one, or one per prompt")
    return values


def _draws(params: Sequence[SamplingParams]) -> SamplingParams | list[SamplingParams]:
    """How the rows draw: the one shared setting when all rows draw alike (the plain
    path; greedy rows draw alike whatever their filters), else each row's own
    (`nexrl_engine.decode.RowDraws`)."""

    def drawing(p: SamplingParams) -> tuple[float, ...]:
        return (0.0,) if p.temperature == 0 else (p.temperature, p.top_k, p.top_p)

    if len({drawing(p) for p in params}) == 1:
        return params[0]
    return list(params)


def _sample_batch(
    model: Any,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    num_samples: int | Sequence[int],
    stop_rule: StopRule | Sequence[StopRule],
    pad_id: int,
    max_positions: int,
    decode: Callable[[list[int]], str],
    base_seed: int,
    prompt_seeds: Sequence[int | None] | None,
    include_prompt_logprobs: bool,
    requests: list[LogprobRequest],
    policy: DecodePolicy,
) -> list[PromptSamples]:
    device = next(model.parameters()).device
    n_prompts = len(prompts)
    prompt_params = _per_prompt(params, SamplingParams, n_prompts, "params")
    rules = _per_prompt(stop_rule, StopRule, n_prompts, "stop_rule")
    limits = []
    for prompt, own in zip(prompts, prompt_params):
        room = max_positions - len(prompt)
        limits.append(room if own.max_tokens is None else min(own.max_tokens, room))
    max_new = max(limits)

    counts = [num_samples] * n_prompts if isinstance(num_samples, int) else list(num_samples)
    # Row r samples prompt_of_row[r] for the (sample_of_row[r])-th time; rows of a prompt are adjacent.
    prompt_of_row = [prompt for prompt, count in enumerate(counts) for _ in range(count)]
    sample_of_row = [sample for count in counts for sample in range(count)]
    seeds = _row_seeds(prompt_of_row, sample_of_row, base_seed, prompt_seeds)
    row_params = [prompt_params[prompt_index] for prompt_index in prompt_of_row]
    # Greedy decoding draws nothing; otherwise every row's numbers for every step, once.
    all_greedy = all(own.temperature == 0 for own in row_params)
    uniforms = None if all_greedy else _draw_uniforms(seeds, max_new).to(device)
    strings = {}
    for rule in rules:
        if rule.strings and id(rule) not in strings:
            strings[id(rule)] = StringStops(rule.strings, rule.window, decode)

    ids, mask = _left_pad(prompts, pad_id, device)
    positions = positions_from_mask(mask)
    scores: list[_PromptScores] = [_PromptScores()] * n_prompts
    every_position = include_prompt_logprobs or any(request.scores_prompt for request in requests)
    keyword = _cache_keyword(model)

    def prefill(cache: Any | None, length: int) -> tuple[Any, torch.Tensor]:
        extra = {} if cache is None else {keyword: cache}
        wide = mask if length == mask.shape[1] else torch.cat([mask, mask.new_zeros((n_prompts, length - mask.shape[1]))], dim=1)
        out = model(
            input_ids=ids,
            attention_mask=wide,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=0 if every_position else 1,
            **extra,
        )
        if every_position:
            scores[:] = _score_prompts(out.logits, ids, prompts, include_prompt_logprobs, requests)
        return (cache if cache is not None else _output_cache(out)), out.logits[:, -1].float()

    expand = None
    if counts != [1] * n_prompts:
        expand = torch.tensor(prompt_of_row, dtype=torch.long, device=device)
    rows = decode_rows(
        model,
        prefill=prefill,
        expand=expand,
        last_position=positions[:, -1:],
        mask=mask,
        uniforms=uniforms,
        limits=[limits[prompt_index] for prompt_index in prompt_of_row],
        params=_draws(row_params),
        stop_ids=[sorted(rules[prompt_index].token_ids) for prompt_index in prompt_of_row],
        strings=[strings.get(id(rules[prompt_index])) for prompt_index in prompt_of_row],
        policy=policy,
        topk=[requests[prompt_index].topk_sample_logprobs for prompt_index in prompt_of_row],
    )

    return _by_prompt(rows, counts, scores)


def _row_seeds(
    prompt_of_row: Sequence[int], sample_of_row: Sequence[int], base_seed: int, prompt_seeds: Sequence[int | None] | None
) -> list[int]:
    """Each row's seed: from the request's seed and the row's place (prompt, sample), or
    from the prompt's own seed and the sample's index, whatever else is in the batch."""
    seeds = []
    for prompt_index, sample_index in zip(prompt_of_row, sample_of_row):
        own = prompt_seeds[prompt_index] if prompt_seeds is not None else None
        if own is None:
            seeds.append(derive_seed(base_seed + sample_index, prompt_index))
        else:
            seeds.append(derive_seed(own + sample_index, 0))
    return seeds


def _by_prompt(rows: Sequence[Any], counts: Sequence[int], scores: Sequence[_PromptScores]) -> list[PromptSamples]:
    """The decoded rows (a prompt's samples adjacent) as each prompt's samples and scores."""
    results = []
    first_row = 0
    for prompt_index, count in enumerate(counts):
        chunk = rows[first_row : first_row + count]
        first_row += count
        scored = scores[prompt_index]
        results.append(
            PromptSamples(
                sequences=[SampledSequence(row.tokens, row.logprobs, row.stop_reason, row.topk) for row in chunk],
                prompt_logprobs=scored.logprobs,
                topk_prompt_logprobs=scored.topk,
                target_prompt_logprobs=scored.targets,
            )
        )
    return results


@attrs.frozen
class _PromptScores:
    logprobs: list[float | None] | None = None
    topk: TopLogprobs | None = None
    targets: list[float] | None = None


def _score_prompts(
    logits: torch.Tensor, ids: torch.Tensor, prompts: Sequence[Sequence[int]], include_prompt_logprobs: bool, requests: list[LogprobRequest]
) -> list[_PromptScores]:
    """What the prefill reports about each prompt, all read off one log-softmax of its
    logits (position j of ``logits[:, :-1]`` predicts token j + 1; prompt row r starts
    at column ``width - len(prompt)`` of the left-padded batch), each kind moved to the
    host in one transfer."""
    raw = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    width = ids.shape[1]
    starts = [width - len(prompt) for prompt in prompts]
    plain = raw.gather(-1, ids[:, 1:, None])[..., 0].cpu() if include_prompt_logprobs else None
    widest = max(request.topk_prompt_logprobs for request in requests)
    top = raw.topk(widest, dim=-1) if widest else None
    top_values, top_ids = (top.values.cpu(), top.indices.cpu()) if top is not None else (None, None)
    cells = [
        (row, starts[row] + position - 1, token)
        for row, request in enumerate(requests)
        if request.target_prompt_logprobs is not None
        for position, token in zip(request.target_prompt_logprobs.positions, request.target_prompt_logprobs.token_ids)
    ]
    targets: list[float] = []
    if cells:
        index = torch.tensor(cells, dtype=torch.long, device=raw.device)
        targets = raw[index[:, 0], index[:, 1], index[:, 2]].tolist()
    scores = []
    taken = 0
    for row, request in enumerate(requests):
        start, k = starts[row], request.topk_prompt_logprobs
        logprobs = [None, *plain[row, start:].tolist()] if plain is not None else None
        topk = None
        if k and top_values is not None and top_ids is not None:
            topk = TopLogprobs(top_ids[row, start:, :k].tolist(), top_values[row, start:, :k].tolist())
        mine = None
        if request.target_prompt_logprobs is not None:
            count = len(request.target_prompt_logprobs.positions)
            mine, taken = targets[taken : taken + count], taken + count
        scores.append(_PromptScores(logprobs, topk, mine))
    return scores
