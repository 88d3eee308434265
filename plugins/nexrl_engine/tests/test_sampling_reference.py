"""The device-side sampler against a plain reference: same tokens, same stop reasons,
same logprobs up to float rounding, whatever the decode policy.

`reference_sample` below is the sampling semantics written the obvious way: one row at a
time, its own batch of one, a token per step, the stop rule asked after every token.
`sample_batch` must agree with it on the shipped tiny model and on a random Qwen2 model
(which emits varied tokens, so that stop ids and stop strings end rows at different
steps): greedy and seeded draws, top-k/top-p, stop ids, stop strings, no stop, the
context limit, per-prompt seeds and counts, prompt logprobs.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from nexrl_engine import Engine, SamplingParams
from nexrl_engine import decode as decode_module
from nexrl_engine.decode import DecodePolicy, StringStops, _cache_keyword, _output_cache, default_policy
from nexrl_engine.sampling import StopRule, derive_seed, make_stop_rule, sample_batch
from nexrl_engine.types import LogprobRequest, PromptSamples, SampledSequence

LOGPROB_TOLERANCE = 1e-4
"""Batched CPU matrix products round a row differently by batch size (seen: up to 2.4e-5
between a row alone and the same row in a batch of 128); tokens must match exactly."""


# --- the reference ---------------------------------------------------------------------------------


def _reference_choose(logits: torch.Tensor, params: SamplingParams, uniform: float) -> int:
    """One draw from [1, vocab] logits: argmax at T=0, else inverse CDF of the
    temperature / top-k / top-p distribution at ``uniform``, the mode if rounding puts the
    target past the end or on a zero-probability token."""
    if params.temperature == 0:
        return int(logits.argmax(dim=-1))
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
    cdf = probs.cumsum(dim=-1)
    target = torch.tensor([[uniform]], dtype=cdf.dtype) * cdf[:, -1:]
    chosen = int(torch.searchsorted(cdf, target, right=True)[0, 0])
    if chosen >= vocab or float(probs[0, chosen]) <= 0:
        return int(probs.argmax(dim=-1))
    return chosen


@torch.inference_mode()
def reference_sample(
    model: Any,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    num_samples: int | Sequence[int],
    stop_rule: StopRule,
    max_positions: int,
    decode: Callable[[list[int]], str],
    base_seed: int,
    prompt_seeds: Sequence[int | None] | None = None,
    include_prompt_logprobs: bool = False,
) -> list[PromptSamples]:
    counts = [num_samples] * len(prompts) if isinstance(num_samples, int) else list(num_samples)
    limits = [max_positions - len(p) if params.max_tokens is None else min(params.max_tokens, max_positions - len(p)) for p in prompts]
    draws = max(limits)  # every row draws this many numbers from its generator, used or not
    results = []
    for index, (prompt, count) in enumerate(zip(prompts, counts)):
        ids = torch.tensor([list(prompt)])
        prompt_logprobs = None
        if include_prompt_logprobs:
            logits = model(input_ids=ids).logits[0, :-1].float()
            scored = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
            prompt_logprobs = [None] + scored.tolist()
        sequences = []
        for sample in range(count):
            own = prompt_seeds[index] if prompt_seeds is not None else None
            seed = derive_seed(base_seed + sample, index) if own is None else derive_seed(own + sample, 0)
            uniforms = torch.rand(draws, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).tolist()
            out = model(input_ids=ids, use_cache=True)
            cache, logits = _output_cache(out), out.logits[:, -1].float()
            tokens: list[int] = []
            logprobs: list[float] = []
            reason = "length"
            while True:
                token = _reference_choose(logits, params, uniforms[len(tokens)])
                tokens.append(token)
                logprobs.append(float(torch.log_softmax(logits, dim=-1)[0, token]))
                if stop_rule.hit(tokens, decode):
                    reason = "stop"
                    break
                if len(tokens) >= limits[index]:
                    break
                position = torch.tensor([[len(prompt) + len(tokens) - 1]])
                out = model(input_ids=torch.tensor([[token]]), position_ids=position, use_cache=True, **{_cache_keyword(model): cache})
                cache, logits = _output_cache(out), out.logits[:, -1].float()
            sequences.append(SampledSequence(tokens, logprobs, reason))  # type: ignore[arg-type]
        results.append(PromptSamples(sequences=sequences, prompt_logprobs=prompt_logprobs))
    return results


# --- fixtures and cases ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def random_qwen(shared_engine: Engine) -> Any:
    """A small randomly initialised Qwen2 model over the shipped vocabulary: its draws are
    varied, so stop ids and strings end rows at many different steps."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    base = shared_engine.model.config
    config = Qwen2Config(
        vocab_size=base.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=base.max_position_embeddings,
        tie_word_embeddings=True,
    )
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    return model


def printable_tokens(engine: Engine, count: int, seed: int) -> list[int]:
    """Token ids whose text is plain ASCII letters (good stop strings)."""
    rng = random.Random(seed)
    ids = [t for t in range(3, engine.vocab_size) if engine._decode_raw([t]).strip().isalpha() and engine._decode_raw([t]).isascii()]
    return rng.sample(ids, count)


def cases(engine: Engine, chat: list[list[int]]) -> list[tuple[str, list[list[int]], SamplingParams, dict]]:
    by_length = {len(p): p for p in chat}
    short, long = by_length[min(by_length)], by_length[max(by_length)]
    mixed = [long, [1, 30, 31], short + [40, 41, 42, 43], short, chat[3]]
    words = [engine._decode_raw([t]) for t in printable_tokens(engine, 6, seed=0)]
    return [
        ("greedy, EOS", mixed, SamplingParams(max_tokens=12, temperature=0.0), {"num_samples": 1}),
        ("greedy, no stop", mixed, SamplingParams(max_tokens=10, temperature=0.0, stop=[]), {"num_samples": 2}),
        ("T=1, EOS", chat[:8], SamplingParams(max_tokens=12, seed=3), {"num_samples": 3}),
        ("T=1.3, no stop", mixed, SamplingParams(max_tokens=9, temperature=1.3, stop=[], seed=11), {"num_samples": 2}),
        ("top-k", mixed, SamplingParams(max_tokens=10, temperature=1.5, top_k=5, seed=5), {"num_samples": 3}),
        ("top-p", mixed, SamplingParams(max_tokens=10, temperature=1.5, top_p=0.8, seed=6), {"num_samples": 3}),
        ("top-k and top-p", mixed, SamplingParams(max_tokens=10, temperature=0.9, top_k=20, top_p=0.9, seed=7), {"num_samples": 3}),
        (
            "stop ids",
            chat[:6],
            SamplingParams(max_tokens=10, temperature=1.2, stop=[19, 26, *printable_tokens(engine, 8, 1)], seed=8),
            {"num_samples": 3},
        ),
        ("greedy, stop ids", mixed, SamplingParams(max_tokens=10, temperature=0.0, stop=[18, 19, 25]), {"num_samples": 1}),
        ("stop strings", chat[:6], SamplingParams(max_tokens=12, temperature=1.4, stop=["1", "<|im_end|>"], seed=9), {"num_samples": 3}),
        (
            "stop strings across tokens",
            chat[:6],
            SamplingParams(max_tokens=16, temperature=2.0, stop=["12", "im_e", "\n", *words], seed=10),
            {"num_samples": 4},
        ),
        ("greedy, stop string", mixed, SamplingParams(max_tokens=12, temperature=0.0, stop=["end|>"]), {"num_samples": 1}),
        (
            "own counts and seeds",
            chat[:3],
            SamplingParams(max_tokens=8, temperature=1.1),
            {"num_samples": [2, 1, 4], "prompt_seeds": [50, None, 70]},
        ),
        (
            "prompt logprobs",
            [chat[0], chat[3][:5], [7]],
            SamplingParams(max_tokens=3, seed=0),
            {"num_samples": 2, "include_prompt_logprobs": True},
        ),
        (
            "context limit",
            mixed,
            SamplingParams(max_tokens=None, temperature=1.0, stop=[], seed=12),
            {"num_samples": 2, "max_positions": len(long) + 6},
        ),
        (
            "context limit, EOS",
            mixed,
            SamplingParams(max_tokens=None, temperature=1.0, seed=13),
            {"num_samples": 2, "max_positions": len(long) + 9},
        ),
        ("one token", mixed, SamplingParams(max_tokens=1, seed=14), {"num_samples": 2}),
        ("one row", [chat[2]], SamplingParams(max_tokens=20, temperature=1.0, seed=15), {"num_samples": 1}),
        ("many rows", chat, SamplingParams(max_tokens=12, temperature=1.0, seed=16), {"num_samples": 3}),
    ]


POLICIES = {
    "default": None,
    "sync every 4, compact at half": DecodePolicy(sync_every=4, compact_at=0.5),
    "never compact": DecodePolicy(sync_every=5, compact_at=1.0),
    "static, growing": DecodePolicy(sync_every=3, compact_at=0.5, static_cache=True, static_chunk=2),
    "static, sync every 8": DecodePolicy(sync_every=8, compact_at=0.25, static_cache=True),
    "static, math attention": DecodePolicy(sync_every=2, compact_at=0.0, static_cache=True, static_chunk=3, math_attention=True),
}


def run(
    engine: Engine, model: Any, prompts: list[list[int]], params: SamplingParams, options: dict, sampler: Callable, **extra: Any
) -> list[PromptSamples]:
    options = dict(options)
    max_positions = options.pop("max_positions", engine.max_positions)
    rule = make_stop_rule(params.stop, engine.eos_token_ids, engine.vocab_size)
    kwargs = dict(stop_rule=rule, max_positions=max_positions, decode=engine._decode_raw, base_seed=params.seed or 0, **options, **extra)
    if sampler is sample_batch:
        kwargs["pad_id"] = engine.pad_token_id
    return sampler(model, prompts, params, **kwargs)


def assert_same(got: list[PromptSamples], want: list[PromptSamples], label: str) -> list[int]:
    lengths = []
    assert len(got) == len(want), label
    for g, w in zip(got, want):
        if w.prompt_logprobs is None:
            assert g.prompt_logprobs is None, label
        else:
            assert g.prompt_logprobs is not None and g.prompt_logprobs[0] is None, label
            assert g.prompt_logprobs[1:] == pytest.approx(w.prompt_logprobs[1:], abs=LOGPROB_TOLERANCE), label
        assert len(g.sequences) == len(w.sequences), label
        for a, b in zip(g.sequences, w.sequences):
            assert (a.tokens, a.stop_reason) == (b.tokens, b.stop_reason), label
            assert a.logprobs == pytest.approx(b.logprobs, abs=LOGPROB_TOLERANCE), label
            assert all(isinstance(x, float) for x in a.logprobs) and all(isinstance(x, int) for x in a.tokens), label
            lengths.append(len(a.tokens))
    return lengths


@pytest.fixture(scope="module")
def references(shared_engine: Engine, chat_prompts: list[list[int]], random_qwen: Any) -> dict:
    out = {}
    for model_name, model in (("tiny", shared_engine.model), ("random", random_qwen)):
        for name, prompts, params, options in cases(shared_engine, chat_prompts):
            out[model_name, name] = run(shared_engine, model, prompts, params, options, reference_sample)
    return out


@pytest.mark.parametrize("policy_name", list(POLICIES))
@pytest.mark.parametrize("model_name", ["tiny", "random"])
def test_sample_batch_matches_the_reference(
    shared_engine: Engine, chat_prompts: list[list[int]], random_qwen: Any, references: dict, model_name: str, policy_name: str
) -> None:
    model = shared_engine.model if model_name == "tiny" else random_qwen
    stopped_early = set()
    for name, prompts, params, options in cases(shared_engine, chat_prompts):
        got = run(shared_engine, model, prompts, params, options, sample_batch, policy=POLICIES[policy_name])
        lengths = assert_same(got, references[model_name, name], f"{model_name} / {policy_name} / {name}")
        if params.stop != () and len(set(lengths)) > 1:
            stopped_early.add(name)
    # The cases exercise what they claim: rows of one call end at different steps.
    assert {"stop ids", "stop strings across tokens"} <= stopped_early or model_name == "tiny"
    assert "T=1, EOS" in stopped_early or model_name == "random"


@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_topk_sample_logprobs_whatever_the_policy(shared_engine: Engine, chat_prompts: list[list[int]], policy_name: str) -> None:
    """Each row records its own top-k at every step, through compaction, a static cache
    that grows and syncs every few tokens: the k most likely tokens of the sequence's own
    teacher-forced distribution, most likely first."""
    model = shared_engine.model
    for name, prompts, params, options in [cases(shared_engine, chat_prompts)[i] for i in (2, 12)]:
        widths = [(2, 0, 4)[i % 3] for i in range(len(prompts))]
        requests = [LogprobRequest(topk_sample_logprobs=k) for k in widths]
        got = run(shared_engine, model, prompts, params, options, sample_batch, policy=POLICIES[policy_name], logprobs=requests)
        assert len({len(s.tokens) for r in got for s in r.sequences}) > 1, f"{name}: rows must end at different steps"
        for prompt, k, result in zip(prompts, widths, got):
            for sequence in result.sequences:
                if k == 0:
                    assert sequence.topk_logprobs is None
                    continue
                with torch.no_grad():
                    logits = model(torch.tensor([prompt + sequence.tokens])).logits[0, len(prompt) - 1 : -1]
                expected = torch.log_softmax(logits.float(), dim=-1).topk(k)
                assert sequence.topk_logprobs is not None, name
                assert sequence.topk_logprobs.token_ids == expected.indices.tolist(), name
                for row, values in zip(sequence.topk_logprobs.logprobs, expected.values.tolist()):
                    assert row == pytest.approx(values, abs=LOGPROB_TOLERANCE), name


def test_the_static_path_with_eager_attention(shared_engine: Engine, chat_prompts: list[list[int]], references: dict) -> None:
    """Eager attention takes an additive float mask instead of sdpa's boolean one."""
    model = shared_engine.model
    before = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        for name, prompts, params, options in cases(shared_engine, chat_prompts)[:12]:
            policy = DecodePolicy(sync_every=3, compact_at=0.5, static_cache=True, static_chunk=2)
            got = run(shared_engine, model, prompts, params, options, sample_batch, policy=policy)
            assert_same(got, references["tiny", name], f"eager / {name}")
    finally:
        model.config._attn_implementation = before


def test_a_failing_static_path_falls_back_to_the_dynamic_cache(
    shared_engine: Engine, chat_prompts: list[list[int]], references: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(cache: Any, length: int) -> None:
        raise RuntimeError("no room")

    monkeypatch.setattr(decode_module, "_grow_static", broken)
    name, prompts, params, options = cases(shared_engine, chat_prompts)[1]  # no stop: every row needs room
    policy = DecodePolicy(sync_every=2, static_cache=True, static_chunk=2)
    with pytest.warns(RuntimeWarning, match="no room"):
        got = run(shared_engine, shared_engine.model, prompts, params, options, sample_batch, policy=policy)
    assert_same(got, references["tiny", name], "fallback")
    # The plain path is not retried: its errors are the caller's.
    monkeypatch.setattr(decode_module, "choose_tokens", lambda *a: (_ for _ in ()).throw(RuntimeError("broken draw")))
    with pytest.raises(RuntimeError, match="broken draw"):
        run(shared_engine, shared_engine.model, prompts, params, options, sample_batch, policy=DecodePolicy())


# --- stop strings, a stretch at a time -------------------------------------------------------------------


def brute_first_hit(rule: StopRule, tokens: list[int], start: int, end: int, decode: Callable[[list[int]], str]) -> int | None:
    for t in range(start, end):
        if rule.hit(tokens[: t + 1], decode):
            return t
    return None


def test_string_stops_find_the_token_the_per_token_rule_stops_at(shared_engine: Engine) -> None:
    """Random token runs (byte tokens that cut multi-byte characters included) and stop
    strings taken from their decoded text, or with accents and CJK characters: the first
    hit in any stretch is the per-token rule's."""
    decode = shared_engine._decode_raw
    rng = random.Random(0)
    vocab = shared_engine.vocab_size
    byte_tokens = [t for t in range(3, vocab) if "\ufffd" in decode([t])]
    assert byte_tokens, "the shipped tokenizer has byte tokens"
    checked = hits = 0
    for _trial in range(300):
        tokens = [rng.choice(byte_tokens) if rng.random() < 0.2 else rng.randrange(3, vocab) for _ in range(rng.randrange(1, 30))]
        text = decode(tokens)
        stops = [rng.choice(["é", "中", "\ufffd", "ab", "<|im_end|>", " the"])]
        if len(text) > 2:
            at = rng.randrange(len(text) - 1)
            stops.append(text[at : at + rng.randrange(1, 5)])
        stops = [s for s in stops if s]
        rule = make_stop_rule(tuple(stops), (), vocab)
        strings = StringStops(rule.strings, rule.window, decode)
        start = rng.randrange(len(tokens))
        end = rng.randrange(start, len(tokens) + 1)
        want = brute_first_hit(rule, tokens, start, end, decode)
        assert strings.first_hit(tokens, start, end) == want, (tokens, stops, start, end)
        checked += 1
        hits += want is not None
    assert checked == 300 and 30 < hits < 270


# --- policy ------------------------------------------------------------------------------------------------


def test_default_policy_by_device() -> None:
    cpu = default_policy(torch.device("cpu"))
    assert not cpu.static_cache and not cpu.cuda_graphs and cpu.sync_every == 1
    cuda = default_policy(torch.device("cuda"))
    assert cuda.static_cache and cuda.cuda_graphs and cuda.math_attention and cuda.sync_every > 1
    with pytest.raises(ValueError, match="sync_every"):
        DecodePolicy(sync_every=0)
    with pytest.raises(ValueError, match="compact_at"):
        DecodePolicy(compact_at=2.0)


# --- CUDA ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_sample_what_the_reference_samples(chat_prompts: list[list[int]]) -> None:
    """On CUDA (static cache, captured decode step) the tiny model in fp32 samples the
    tokens the eager dynamic path and the CPU reference sample."""
    engine = Engine(model="nexrl-tiny", seed=0, device="cuda")
    cpu_engine = Engine(model="nexrl-tiny", seed=0)
    graphs = default_policy(torch.device("cuda"))
    assert graphs.cuda_graphs
    eager = DecodePolicy(sync_every=8, compact_at=0.5)
    for name, prompts, params, options in cases(cpu_engine, chat_prompts):
        want = run(cpu_engine, cpu_engine.model, prompts, params, options, reference_sample)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no fallback, no failed capture
            fast = run(engine, engine.model, prompts, params, options, sample_batch, policy=graphs)
        plain = run(engine, engine.model, prompts, params, options, sample_batch, policy=eager)
        assert_same(fast, want, f"cuda graphs / {name}")
        assert_same(plain, want, f"cuda eager / {name}")
