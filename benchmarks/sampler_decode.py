"""Time `nexrl_engine.sampling.sample_batch` per decoded token.

A rollout's sampling step in isolation: ``--prompts`` chat-formatted addition prompts x
``--samples`` samples, ``--tokens`` new tokens, at T=1 with a fixed seed, on the shipped
tiny model or a randomly initialised Qwen2-shaped model of about 10M or 50M parameters
(the shapes of ``benchmarks/scaling.py``: the shipped vocabulary and tokenizer, tied
embeddings, head dim 64, two key/value heads). Prints, per size, the median wall time of
a call (and the fastest, steadier on a shared machine), ms per decode step (median
call time / ``--tokens``) and generated tokens/s.

``--stop none`` (the default) never stops early, so every call decodes ``--tokens``
steps; ``--stop ids`` stops rows at a few token ids the random models emit now and then
(rows end at different steps, as in RL); ``--stop strings`` does the same with stop
strings; ``--stop eos`` is the engine's default.

``--baseline FILE`` also times the ``sample_batch`` of another implementation (a copy
of an older ``sampling.py``, e.g. ``git show REV:plugins/nexrl_engine/nexrl_engine/sampling.py >
/tmp/old.py``), interleaved with the current one in the same process, and checks that
both return the same tokens.

Run: ``python benchmarks/sampler_decode.py [--device cpu|cuda] [--sizes tiny 10m 50m]
[--dtype float32|bfloat16] [--baseline FILE]``
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SIZES: dict[str, dict[str, int] | None] = {
    "tiny": None,
    "10m": {"hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 6, "num_attention_heads": 6},
    "50m": {"hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 10, "num_attention_heads": 10},
}
"""As in ``benchmarks/scaling.py``: None is the shipped model, else the Qwen2 shape."""
INHERITED_CONFIG = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")


def build_model(size: str, dtype: Any, device: str, seed: int) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from nexrl_engine.loading import load_model, resolve_model_dir

    shipped = resolve_model_dir("nexrl-tiny")
    shape = SIZES[size]
    if shape is None:
        return load_model(shipped, dtype, device)
    base = Qwen2Config.from_pretrained(shipped)
    config = Qwen2Config(
        **{name: getattr(base, name) for name in INHERITED_CONFIG}, tie_word_embeddings=True, num_key_value_heads=2, **shape
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.to(device)
    model.eval()
    return model


def load_sampler(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("baseline_sampling", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def prompts(tokenizer: Any, count: int) -> list[list[int]]:
    from nexrl_engine.tiny.addition import heldout_problems

    return [
        list(tokenizer.apply_chat_template(p.messages(), add_generation_prompt=True, tokenize=True, return_dict=False))
        for p in heldout_problems(count)
    ]


def stop_for(kind: str, tokenizer: Any) -> tuple | None:
    if kind == "none":
        return ()
    if kind == "eos":
        return None
    if kind == "ids":
        return tuple(range(100, 116))  # 16 of 1024 ids: a row of a random model stops after ~64 tokens on average
    words = [t for t in range(100, 1024) if tokenizer.decode([t]).strip().isalpha() and tokenizer.decode([t]).isascii()]
    return tuple(tokenizer.decode([token]) for token in words[:16])


def time_calls(call: Callable[[], Any], repeats: int) -> tuple[list[float], Any]:
    import torch

    times, result = [], None
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = call()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times, result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sizes", nargs="+", choices=tuple(SIZES), default=["tiny", "10m", "50m"])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--stop", choices=("none", "ids", "strings", "eos"), default="none")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per implementation (after one warm-up call)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--baseline", help="a sampling.py to time against, in the same process")
    parser.add_argument("--sync-every", type=int, help="override the decode policy: host check every N tokens")
    parser.add_argument("--compact-at", type=float, help="override the decode policy: compaction threshold")
    parser.add_argument("--static", choices=("on", "off"), help="override the decode policy: static cache")
    parser.add_argument("--graphs", choices=("on", "off"), help="override the decode policy: CUDA graphs")
    parser.add_argument("--math-attention", choices=("on", "off"), help="override the decode policy: sdpa math backend")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nexrl_fsdp"))
    import attrs
    import torch

    from nexrl_engine.decode import COUNTERS, default_policy
    from nexrl_engine.loading import load_tokenizer, resolve_model_dir
    from nexrl_engine.sampling import make_stop_rule, sample_batch
    from nexrl_engine.types import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    policy = default_policy(device)
    overrides: dict[str, Any] = {}
    if args.sync_every is not None:
        overrides["sync_every"] = args.sync_every
    if args.compact_at is not None:
        overrides["compact_at"] = args.compact_at
    if args.static is not None:
        overrides["static_cache"] = args.static == "on"
    if args.graphs is not None:
        overrides["cuda_graphs"] = args.graphs == "on"
    if args.math_attention is not None:
        overrides["math_attention"] = args.math_attention == "on"
    policy = attrs.evolve(policy, **overrides)
    baseline = load_sampler(args.baseline) if args.baseline else None
    tokenizer = load_tokenizer(resolve_model_dir("nexrl-tiny"))
    batch = prompts(tokenizer, args.prompts)
    params = SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=7, stop=stop_for(args.stop, tokenizer))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(
        f"# {name}; torch {torch.__version__}; {args.dtype}; {args.prompts} prompts x {args.samples} samples, "
        f"{args.tokens} new tokens, stop={args.stop}; policy {policy}"
    )
    print("| size | params | impl | s/call (median) | s/call (min) | ms/token | tokens/s | rows x tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for size in args.sizes:
        model = build_model(size, dtype, args.device, seed=0)
        n_params = sum(p.numel() for p in model.parameters())
        vocab = int(model.get_input_embeddings().num_embeddings)
        rule = make_stop_rule(params.stop, (int(tokenizer.eos_token_id),), vocab)
        common = dict(
            num_samples=args.samples,
            pad_id=int(tokenizer.pad_token_id or 0),
            max_positions=int(model.config.max_position_embeddings),
            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False),
            base_seed=7,
        )
        sides: list[tuple[str, Callable[[], Any]]] = [
            ("new", lambda: sample_batch(model, batch, params, stop_rule=rule, policy=policy, **common)),  # noqa: B023, F821 - called in this iteration
        ]
        if baseline is not None:
            old_rule = baseline.make_stop_rule(params.stop, (int(tokenizer.eos_token_id),), vocab)
            sides.insert(0, ("baseline", lambda: baseline.sample_batch(model, batch, params, stop_rule=old_rule, **common)))  # noqa: B023, F821 - called in this iteration
        times: dict[str, list[float]] = {side: [] for side, _ in sides}
        outputs: dict[str, Any] = {}
        for _, call in sides:
            call()  # warm-up
        for _ in range(args.repeats):
            for side, call in sides:
                elapsed, outputs[side] = time_calls(call, 1)
                times[side] += elapsed
        for side, _ in sides:
            median = statistics.median(times[side])
            generated = sum(len(s.tokens) for r in outputs[side] for s in r.sequences)
            rows = sum(len(r.sequences) for r in outputs[side])
            print(
                f"| {size} | {n_params / 1e6:.1f}M | {side} | {median:.4f} | {min(times[side]):.4f} | {1000 * median / args.tokens:.2f} | "
                f"{generated / median:,.0f} | {rows} x {generated / rows:.1f} |"
            )
        if baseline is not None:
            same = [[s.tokens for s in r.sequences] for r in outputs["new"]] == [
                [s.tokens for s in r.sequences] for r in outputs["baseline"]
            ]
            worst = max(
                (
                    abs(a - b)
                    for rn, rb in zip(outputs["new"], outputs["baseline"])
                    for sn, sb in zip(rn.sequences, rb.sequences)
                    for a, b in zip(sn.logprobs, sb.logprobs)
                ),
                default=0.0,
            )
            print(f"|  |  | same tokens: {same}; max logprob diff {worst:.1e} |  |  |  |  |  |")
        print(f"# decode loop so far: {dict(COUNTERS)}")
        del model
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
