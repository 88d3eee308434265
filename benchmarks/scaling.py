"""NexRL on each installed local backend against TRL's ``GRPOTrainer`` at three model sizes.

One invocation trains, side by side, at every size in ``--sizes``:

* ``tiny``: the shipped ``nexrl-tiny`` (2.6M parameters counting its tied embedding once,
  pretrained on addition);
* ``10m`` and ``50m``: Qwen2-shaped models of about 10M and 50M parameters built from
  ``transformers.Qwen2Config`` with the shipped tokenizer and chat template, randomly
  initialised with ``--seed`` and saved as HF directories in the work dir (NexRL's
  ``model.name`` takes the directory, TRL loads it);

and, per size, every side in `NEXRL_SIDES` whose plugin is installed plus TRL, each in its
own child process. NexRL runs the built-in quickstart recipe with the user's-own-task
keys: ``task.data_path`` (the addition prompts as JSONL in the work dir) and
``task.agent: digits_task:agent``, whose reward is the fraction of the reply that is
digits (see `digits_task` for why that reward: a random model can improve it). TRL gets
the same prompts in NexRL's order, the same reward, seed, group size, max new tokens,
learning rate and AdamW settings (`grpo_sides.trl_grpo_config`).

Measured (the same way as `vs_trl.py`, through `grpo_sides`): s/step is the median over
steps 2..N (NexRL: ``time/step_s``, with its split ``time/rollout_s`` / ``time/train_s`` /
``time/sync_s``; TRL: ``on_step_begin``..``on_step_end``); reward is ONE evaluation of
every final model (NexRL's ``<output.dir>/final_model``, or its step-N checkpoint on a
backend that cannot export one; TRL's saved model) and of the
untrained start: the first ``--val-size`` held-out addition prompts, ``--eval-samples``
samples each at T=1 with a fixed seed in fp32, digit fraction, mean ± standard error.

``--dtype bfloat16`` trains in bf16 (``model.dtype=bf16`` on NexRL, the model loaded in
``torch.bfloat16`` on TRL); a backend that refuses bf16 before step 1 is shown as refused,
with its reason. Targets, printed as PASS/FAIL per size and side: NexRL s/step at most
0.5x TRL's, and NexRL's reward at least TRL's within one standard error; and each worker-group
side against the same work on an in-process engine (`PEER_TARGETS`): the embedded Tinker
service on 1-rank groups at most 1.3x its s/step on the in-process engine, and a 1-rank
self-hosted run's train phase at most 1.5x the in-process backend's. Exit status 0
whatever the verdict: this is a benchmark, not a test.

``--device cuda`` (or ``cuda:N``) runs every side on that GPU (NexRL's engines, services and
samplers; TRL without ``use_cpu``; the evaluation) and adds ``1.5b``, a Qwen2.5-1.5B shape
(hidden 1536, 28 layers, 12 heads, 2 key/value heads, intermediate 8960, vocabulary 151 936,
tied embeddings, random init) trained in bf16 whatever ``--dtype`` says; the default sizes
there are ``10m 50m 1.5b``. A GPU run also prints, per size and side, s/step, rollout and
training tokens/s, rows trained per step, peak GPU memory and MFU (`grpo_sides.gpu_throughput`).
``--reward length`` trains on the reply's length instead of its digits, so that random
models give every GRPO group something to learn and every side trains every row (see
`digits_task`). A device this machine lacks stops the script at once.

Run: ``python benchmarks/scaling.py [--sizes tiny 10m 50m 1.5b] [--steps 6]
[--prompts-per-step 8] [--group-size 4] [--dtype float32|bfloat16] [--only SIDE ...]
[--device cpu|cuda|cuda:N] [--reward digits|length]``.
Needs ``trl`` installed under the torch pin: ``pip install -c constraints.txt trl``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpo_sides as shared  # first: sets the offline environment before torch loads
from digits_task import REWARDS, messages
from grpo_sides import STEP_PARTS, fmt, median_after_first, ratio

NEXRL_SIDES: dict[str, tuple[str, tuple[str, ...]]] = {
    "remote_api": ("nexrl_tinker", ()),
    "remote_api_workers1": ("nexrl_tinker", ("backend.options.workers=1",)),
    "remote_api_workers2": ("nexrl_tinker", ("backend.options.workers=2",)),
    "inprocess": ("nexrl_fsdp", ("backend.name=inprocess", "backend.options={}")),
    "weaver": ("nexrl_weaver", ("backend.options.service_holder=weaver",)),
    "self-hosted": ("nexrl_fsdp", ("backend.name=self-hosted", "backend.options.update.micro_batch_rows=64")),
    "self-hosted_1rank": (
        "nexrl_fsdp",
        (
            "backend.name=self-hosted",
            "backend.options.world_size=1",
            "backend.options.update.micro_batch_rows=64",
            "backend.options.recompute_old_logprobs=false",
        ),
    ),
}
"""NexRL's local backends: side name -> (module that must be installed, recipe overrides
on top of the quickstart, whose backend is ``remote_api`` on the embedded Tinker
service; ``_workersN``: that service training the model on a worker group of N ranks;
self-hosted: a rank's share of a step in one pass, as ``recipes/quickstart_fsdp.yaml``
and as the in-process engine does; ``_1rank`` also trains on the sampler's logprobs
instead of recomputing them, as the in-process backend it is compared with does).
A new backend is one more line."""
TRL = "trl"
SIZES: dict[str, dict[str, int] | None] = {
    "tiny": None,
    "10m": {"hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 6, "num_attention_heads": 6},
    "50m": {"hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 10, "num_attention_heads": 10},
    "1.5b": {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "vocab_size": 151936,
    },  # fmt: skip
}
"""Model sizes: ``None`` is the shipped model; otherwise the Qwen2 shape that differs from
the shipped config (head dim 64, two key/value heads, the shipped vocabulary unless given,
tied embeddings). ``1.5b`` is Qwen2.5-1.5B's shape."""
DEFAULT_SIZES = {"cpu": ("tiny", "10m", "50m"), "cuda": ("10m", "50m", "1.5b")}
"""What ``--sizes`` defaults to on a CPU and on a GPU."""
SIZE_DTYPES = {"1.5b": "bfloat16"}
"""Sizes trained in this dtype whatever ``--dtype`` says."""
FINAL_NORM_WEIGHT = 6.0
"""In a size whose vocabulary is larger than the tokenizer (``1.5b``), the embedding rows past
the shipped tokenizer's 1 024 tokens start at zero and the final norm's weight at this
instead of 1. With every row random and a weight of 1, a random 151 936-row model samples a
token the tokenizer has in under 1 % of places, so nearly every reply is empty and every
group ties; with these (measured on the 28-layer shape at T=1) it samples one of them in
97 % of places, about 21 distinct tokens in a group's 32, and every group's replies differ
in length. Scaling the embedding rows instead makes a tied model repeat its last token."""
SHIPPED = "nexrl-tiny"
INHERITED_CONFIG = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")
"""What built sizes take from the shipped config, so the shipped tokenizer fits them."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
SPEED_TARGET = 0.5
"""NexRL s/step must be at most this multiple of TRL's."""
PEER_TARGETS: dict[str, tuple[str, str, float]] = {
    "remote_api_workers1": ("remote_api", "step", 1.3),
    "self-hosted_1rank": ("inprocess", "train", 1.5),
}
"""A worker-group side against the same work on an in-process engine: side -> (peer side,
what is compared: ``step`` for s/step or a phase of `STEP_PARTS`, most allowed ratio)."""
DTYPES = {"float32": "fp32", "bfloat16": "bf16"}
"""``--dtype`` -> NexRL's ``model.dtype``."""


def installed_sides() -> list[str]:
    return [side for side, (module, _) in NEXRL_SIDES.items() if importlib.util.find_spec(module) is not None]


# --- models and data -----------------------------------------------------------------------------


def build_model(size: str, work: Path, seed: int, device: str = "cpu") -> tuple[str, int]:
    """The model directory (or shipped name) for ``size`` and its parameter count; built
    sizes are random Qwen2 models saved once per work dir with the shipped tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from nexrl_engine.loading import resolve_model_dir

    shipped = resolve_model_dir(SHIPPED)
    shape = SIZES[size]
    if shape is None:
        model = AutoModelForCausalLM.from_pretrained(shipped)
        return SHIPPED, sum(p.numel() for p in model.parameters())
    target = work / f"model_{size}"
    base = Qwen2Config.from_pretrained(shipped)
    inherited = {name: getattr(base, name) for name in INHERITED_CONFIG}
    config = Qwen2Config(**{**inherited, **shape}, tie_word_embeddings=True, num_key_value_heads=2)
    torch.manual_seed(seed)
    # Built on the benchmark's device in the size's dtype: a 1.5B model initialises in
    # seconds there (the CPU sizes are built exactly as before, in fp32 on the CPU).
    dtype = torch.bfloat16 if SIZE_DTYPES.get(size) == "bfloat16" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tokens = base.vocab_size
    if config.vocab_size > tokens:
        with torch.no_grad():
            model.get_input_embeddings().weight[tokens:] = 0
            model.model.norm.weight.fill_(FINAL_NORM_WEIGHT)
    if not (target / "config.json").exists():
        model.save_pretrained(target)
        for name in TOKENIZER_FILES:
            if (shipped / name).exists():
                shutil.copy(shipped / name, target / name)
    return str(target), sum(p.numel() for p in model.parameters())


def write_prompts(work: Path, count: int, val_size: int) -> tuple[Path, Path]:
    """Training and held-out addition prompts as JSONL (``{"a": .., "b": ..}`` per line)."""
    from nexrl_engine.tiny.addition import heldout_problems, train_problems

    paths = work / "prompts_train.jsonl", work / "prompts_val.jsonl"
    for path, problems in zip(paths, (train_problems()[:count], heldout_problems(val_size))):
        path.write_text("".join(json.dumps({"id": p.prompt, "a": p.a, "b": p.b}) + "\n" for p in problems))
    return paths


def nexrl_config(args: argparse.Namespace, side: str, out_dir: Path) -> Any:
    """The quickstart recipe on ``side`` with the digits task and the shared settings."""
    from importlib.resources import as_file, files

    from nexrl_core.config import load_config

    work = Path(args.work_dir)
    train_path, val_path = work / "prompts_train.jsonl", work / "prompts_val.jsonl"
    overrides = [
        *NEXRL_SIDES[side][1],
        *shared.device_overrides(args, backend_of(side)),
        f"model.name={args.model_dir}",
        f"model.dtype={DTYPES[args.dtype]}",
        f"task.data_path={train_path}",
        f"task.val_data_path={val_path}",
        f"task.agent={REWARDS[args.reward][1]}",
        *shared.common_overrides(args, out_dir),
    ]
    with as_file(files("nexrl_core").joinpath("recipes", "quickstart.yaml")) as recipe:
        return load_config(recipe, overrides)


# --- the sides (each in its own child process) ----------------------------------------------------


def backend_of(side: str) -> str:
    """The ``backend.name`` a side runs (its overrides', else the quickstart's ``remote_api``)."""
    names = [override.partition("=")[2] for override in NEXRL_SIDES.get(side, ("", ()))[1] if override.startswith("backend.name=")]
    return names[-1] if names else "remote_api"


def run_nexrl(args: argparse.Namespace, side: str) -> dict[str, Any]:
    import logging

    from nexrl_core.run.loop import run_training

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("nexrl").setLevel(logging.INFO)
    out_dir = Path(args.work_dir) / f"{args.size}_{side}_run"
    config = nexrl_config(args, side, out_dir)
    shared.seed_everything(args.seed)
    started = time.perf_counter()
    summary = run_training(config, overwrite=True, progress_bar=False)
    wall = time.perf_counter() - started
    return {
        "side": side,
        "steps_done": summary.steps,
        **shared.nexrl_step_metrics(summary.metrics_path),
        "wall_s": wall,
        # The exported final model; where the backend cannot export one, its step-N checkpoint.
        "model_dir": str(summary.final_model) if summary.final_model else args.model_dir,
        "checkpoint": None if summary.final_model else shared.nexrl_final_checkpoint(out_dir, args.steps),
        "final_model_error": summary.final_model_error,
        **shared.gpu_peak_allocated(),
    }


def run_trl(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    work = Path(args.work_dir)
    from nexrl_engine.loading import resolve_model_dir

    source = resolve_model_dir(args.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = "<|endoftext|>"
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    config = nexrl_config(args, "remote_api", work / "unused")
    items = shared.nexrl_training_items(config, args.steps * args.prompts_per_step)
    dataset = Dataset.from_list([{"prompt": messages(item)} for item in items])

    score = REWARDS[args.reward][0]

    def digits(prompts: list, completions: list, completion_ids: list, **_: Any) -> list[float]:
        return [score(shared.decode_raw(tokenizer, ids)) for ids in completion_ids]

    grpo = shared.trl_grpo_config(args, config.algorithm, work / f"{args.size}_trl_out")
    return shared.train_trl(model, tokenizer, dataset, digits, grpo, work / f"{args.size}_trl_final_model")


# --- evaluation and the table ---------------------------------------------------------------------


def evaluate(weights_dir: str, checkpoint: str | None, args: argparse.Namespace, stop: tuple[int, ...] | None = None) -> tuple:
    from nexrl_engine.tiny.addition import heldout_problems

    conversations = [problem.messages() for problem in heldout_problems(args.val_size)]
    score = REWARDS[args.reward][0]
    return shared.evaluate_policy(
        weights_dir,
        checkpoint,
        conversations,
        lambda _index, text: score(text),
        max_tokens=args.max_tokens,
        samples=args.eval_samples,
        seed=args.seed,
        stop=stop,
        device=args.device,
    )


def refusal(result: dict[str, Any]) -> str | None:
    """The reason a side refused ``model.dtype`` before step 1, from its log, if that is why it failed."""
    lines = [line.strip() for line in result.get("log_tail", []) if "model.dtype" in line]
    return lines[-1] if lines else None


def size_rows(size: str, params: int, sides: list[str], results: dict, evals: dict) -> tuple[list[str], list[str]]:
    """Table rows and verdicts of one size."""
    trl_speed = median_after_first(results[TRL]["step_seconds"]) if "step_seconds" in results.get(TRL, {}) else None
    trl_eval = evals.get(TRL)
    rows, verdicts = [], []
    for side in sides:
        result = results[side]
        label = f"| {size} ({params / 1e6:.1f}M) | {'TRL' if side == TRL else 'NexRL ' + side} |"
        if "error" in result:
            why = refusal(result) or f"failed ({result['error']}; see {size}_{side}.log)"
            rows.append(f"{label} refused: {why} |" if refusal(result) else f"{label} {why} |")
            verdicts.append(f"{size} {side}: NOT MEASURED ({why})")
            continue
        speed = median_after_first(result["step_seconds"])
        parts = result.get("step_parts", {})
        split = " / ".join(fmt(parts.get(part), 2) for part in STEP_PARTS) if parts else "-"
        mean, err = (evals[side][0], evals[side][1]) if side in evals else (None, None)
        reward = f"{fmt(mean)} ± {fmt(err)}"
        speed_ratio = ratio(speed, trl_speed) if side != TRL else None
        diff = mean - trl_eval[0] if side != TRL and mean is not None and trl_eval else None
        cells = [fmt(speed), split, reward, fmt(speed_ratio, 2) if side != TRL else "", "" if diff is None else f"{diff:+.3f}"]
        rows.append(f"{label} " + " | ".join(cells) + " |")
        if side == TRL:
            continue
        noise = ((err or 0.0) ** 2 + (trl_eval[1] if trl_eval else 0.0) ** 2) ** 0.5
        speed_ok = speed_ratio is not None and speed_ratio <= SPEED_TARGET
        reward_ok = diff is not None and diff >= -noise
        verdicts.append(
            f"{size} {side}: speed {'PASS' if speed_ok else 'FAIL'} ({fmt(speed_ratio, 2)}x TRL, target <= {SPEED_TARGET}x); "
            f"reward {'PASS' if reward_ok else 'FAIL'} (diff {fmt(diff)} vs one standard error {noise:.3f})"
        )
    verdicts.extend(peer_verdicts(size, sides, results))
    return rows, verdicts


def _seconds(result: dict[str, Any], what: str) -> float | None:
    """A side's median s/step (``step``) or median seconds of one step phase."""
    if "error" in result:
        return None
    if what == "step":
        return median_after_first(result["step_seconds"])
    return result.get("step_parts", {}).get(what)


def peer_verdicts(size: str, sides: list[str], results: dict) -> list[str]:
    """Each worker-group side of `PEER_TARGETS` against its in-process peer."""
    verdicts = []
    for side, (peer, what, limit) in PEER_TARGETS.items():
        if side not in sides or peer not in sides:
            continue
        mine, theirs = _seconds(results[side], what), _seconds(results[peer], what)
        measured = ratio(mine, theirs)
        if what != "step" and results[peer].get("datums_trained") == 0:
            verdict = f"NOT COMPARABLE ({peer} trained no datum: every group's rewards were equal, so it skips the update)"
        else:
            verdict = "NOT MEASURED" if measured is None else ("PASS" if measured <= limit else "FAIL")
        label = "s/step" if what == "step" else f"{what} s"
        verdicts.append(
            f"{size} {side}: {label} {fmt(mine, 2)} vs {peer} {fmt(theirs, 2)}: {verdict} ({fmt(measured, 2)}x, target <= {limit}x)"
        )
    return verdicts


def report(args: argparse.Namespace, table: list[str], verdicts: list[str], starts: dict[str, tuple]) -> None:
    print()
    forced = [f"{size} in {SIZE_DTYPES[size]}" for size in args.sizes if size in SIZE_DTYPES and SIZE_DTYPES[size] != args.dtype]
    print(f"## NexRL vs TRL GRPOTrainer by model size ({'; '.join([args.dtype, *forced])})")
    reward = "digit fraction of the reply" if args.reward == "digits" else "reply length (characters / 64, at most 1)"
    where = "" if args.device == "cpu" else f", on {args.device}"
    print(
        f"{args.steps} steps x {args.prompts_per_step} prompts x {args.group_size} samples, max_tokens {args.max_tokens}, "
        f"lr {args.lr}, seed {args.seed}, {args.threads} torch threads per process; reward = {reward} "
        f"on {args.val_size} held-out prompts x {args.eval_samples} samples (T=1, fp32, same sampler for every model{where})"
    )
    print("untrained start reward: " + ", ".join(f"{size} {fmt(value[0])} ± {fmt(value[1])}" for size, value in starts.items()))
    print()
    print(
        "| size | side | s/step (median 2..N) | NexRL split rollout / train / sync s | reward after N ± se | s/step vs TRL | reward - TRL |"
    )
    print("|---|---|---|---|---|---|---|")
    print("\n".join(table))
    print()
    for verdict in verdicts:
        print("VERDICT " + verdict)


# --- orchestration --------------------------------------------------------------------------------


def size_dtype(args: argparse.Namespace, size: str) -> str:
    """The dtype ``size`` trains in: `SIZE_DTYPES`, else ``--dtype``."""
    return SIZE_DTYPES.get(size, args.dtype)


def worker_argv(args: argparse.Namespace, size: str, model_dir: str) -> list[str]:
    argv = [*shared.common_argv(args), f"--dtype={size_dtype(args, size)}", f"--size={size}", f"--model-dir={model_dir}"]
    return argv if args.reward == "digits" else [*argv, f"--reward={args.reward}"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--sizes",
        nargs="+",
        choices=tuple(SIZES),
        default=None,
        help=f"model sizes to run (default on a CPU: {' '.join(DEFAULT_SIZES['cpu'])}; on a GPU: {' '.join(DEFAULT_SIZES['cuda'])})",
    )
    shared.add_common_arguments(parser, steps=6, prompts=8, group=4, val_size=64)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--only", nargs="+", choices=(*NEXRL_SIDES, TRL), help="run only these sides")
    parser.add_argument(
        "--reward",
        choices=tuple(REWARDS),
        default="digits",
        help="digits: the digit fraction of the reply (default); length: its length, which random models vary in every group",
    )
    parser.add_argument("--worker", choices=(*NEXRL_SIDES, TRL), help=argparse.SUPPRESS)
    parser.add_argument("--size", choices=tuple(SIZES), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    shared.check_positive(parser, args)
    if args.sizes is None:
        args.sizes = list(DEFAULT_SIZES["cpu" if args.device == "cpu" else "cuda"])
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shared.pin_threads(args.threads)
    if args.worker:
        result = run_trl(args) if args.worker == TRL else run_nexrl(args, args.worker)
        Path(args.work_dir, f"{args.size}_{args.worker}_result.json").write_text(json.dumps(result, indent=2))
        return 0

    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="nexrl_scaling_"))
    work.mkdir(parents=True, exist_ok=True)
    import torch

    sides = [side for side in (*installed_sides(), TRL) if not args.only or side in args.only]
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"{args.threads} torch threads per process; sides {', '.join(sides)}; work dir {work}",
        flush=True,
    )
    write_prompts(work, args.steps * args.prompts_per_step, args.val_size)
    table: list[str] = []
    verdicts: list[str] = []
    starts: dict[str, tuple] = {}
    on_gpu = args.device != "cpu"
    if on_gpu:
        card, peak_flops = shared.card(args.device, args.peak_tflops)
        print(f"GPU: {card} ({args.device}); MFU against {fmt(peak_flops and peak_flops / 1e12, 0)} TFLOP/s dense bf16", flush=True)
        prompts = [messages(json.loads(line)) for line in (work / "prompts_train.jsonl").read_text().splitlines()]
        prompt_tokens = shared.mean_prompt_tokens(SHIPPED, prompts)
    gpu_table: list[str] = []
    for size in args.sizes:
        model_dir, params = build_model(size, work, args.seed, args.device)
        if on_gpu:
            torch.cuda.empty_cache()
        print(f"== {size}: {params:,} parameters ({model_dir})", flush=True)
        argv_ = worker_argv(args, size, model_dir)
        results = {side: shared.run_child(Path(__file__), side, argv_, work, tag=f"{size}_{side}", device=args.device) for side in sides}
        print(f"[{size}] evaluating every final model with the same sampler ...", flush=True)
        starts[size] = evaluate(model_dir, None, args)
        stop = starts[size][3]
        evals = {
            side: evaluate(result["model_dir"], result.get("checkpoint"), args, stop=stop)
            for side, result in results.items()
            if "error" not in result
        }
        rows, size_verdicts = size_rows(size, params, sides, results, evals)
        table += rows
        verdicts += size_verdicts
        if on_gpu:
            for side in sides:
                if "error" not in results[side]:
                    numbers = shared.gpu_throughput(results[side], params, prompt_tokens, peak_flops)
                    name = "TRL" if side == TRL else f"NexRL {side}"
                    gpu_table.append(
                        f"| {size} ({params / 1e6:.1f}M, {size_dtype(args, size)}) | {name} | {shared.gpu_cells(results[side], numbers)} |"
                    )
        for side, result in results.items():
            if "step_seconds" in result:
                print(f"[{size}] {side} every step's s: " + " ".join(f"{s:.2f}" for s in result["step_seconds"]))
    report(args, table, verdicts, starts)
    if on_gpu:
        print()
        print(
            f"## Throughput on {card} ({'MFU against %.0f TFLOP/s dense bf16' % (peak_flops / 1e12) if peak_flops else 'peak FLOP/s unknown: pass --peak-tflops'})"
        )
        print(
            "steps 2..N; rollout tokens/s = sampled tokens / rollout phase s; training tokens/s = prompt + completion tokens "
            f"of the rows trained / train phase s (NexRL: {prompt_tokens:.1f} prompt tokens per row, the mean); "
            "MFU = 6 x parameters x training tokens/s / peak"
        )
        print()
        print("| size | side " + shared.GPU_TABLE_HEADER)
        print("|---|---|---|---|---|---|---|---|---|")
        print("\n".join(gpu_table))
    shared.finish_work_dir(args, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
