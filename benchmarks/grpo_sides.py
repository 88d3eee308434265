"""What every NexRL-against-TRL benchmark in this folder does the same way.

`vs_trl.py` (the quickstart's addition task on the shipped model) and `scaling.py` (a
dense reward at three model sizes) differ in task, models and table, but must measure
alike, or their numbers would not be comparable: each side trains in its own child
process, s/step is the median over steps 2..N, NexRL's step split comes from
``metrics.jsonl``, TRL's ``GRPOTrainer`` gets the same prompts, group size and AdamW
settings, and one evaluation function samples every final model with the same engine,
seed and stop tokens. Those pieces live here, once.

``--device cuda`` (or ``cuda:N``) runs every side on that GPU: NexRL's engines, services and
samplers (`DEVICE_KEYS`), TRL without ``use_cpu``, and the evaluation. On a GPU each side
also reports its throughput (`gpu_throughput`): rollout and training tokens per second,
its peak GPU memory and its MFU against the card's peak dense bf16 FLOP/s (`PEAK_BF16_FLOPS`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# Offline, no telemetry, and the same OpenMP wait policy in every process of both sides:
# importing nexrl_fsdp (light, no torch) sets its default in os.environ before anything
# loads torch, and child processes inherit it. Scripts import this module first.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TINKER_API_KEY", "tml-benchmark")
os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
import nexrl_engine  # noqa: E402, F401

STEP_PARTS = ("rollout", "train", "sync")
"""NexRL's step phases, each logged as ``time/<part>_s`` in ``metrics.jsonl``."""
DEVICE = re.compile(r"cpu|cuda(:[0-9]+)?")
"""What ``--device`` accepts."""
PEAK_BF16_FLOPS = {"H200": 989e12, "H100 PCIe": 756e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}
"""Peak dense bf16 FLOP/s of a card, by a part of its name (torch.cuda.get_device_name), the
first match in this order (H100 SXM and H200: 989 TFLOP/s; ``--peak-tflops`` overrides)."""


POSITIVE_ARGUMENTS = ("steps", "prompts_per_step", "group_size", "max_tokens", "val_size", "eval_samples", "threads")


def add_common_arguments(parser: argparse.ArgumentParser, *, steps: int, prompts: int, group: int, val_size: int) -> None:
    """The run-shape options both sides share, with a script's own defaults."""
    parser.add_argument("--steps", type=int, default=steps, help=f"training steps on each side (default {steps})")
    parser.add_argument("--prompts-per-step", type=int, default=prompts)
    parser.add_argument("--group-size", type=int, default=group)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--val-size", type=int, default=val_size, help=f"held-out prompts to evaluate (default {val_size})")
    parser.add_argument("--eval-samples", type=int, default=4, help="samples per held-out prompt (default 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads in every process (default 2)")
    parser.add_argument("--work-dir", help="where runs and models go (default: a new temp dir, removed unless --keep)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir")
    parser.add_argument(
        "--device",
        default="cpu",
        help="where every side trains, samples and is evaluated: cpu (default), cuda or cuda:N",
    )
    parser.add_argument(
        "--peak-tflops", type=float, default=None, help="the GPU's peak dense bf16 TFLOP/s for MFU (default: known from its name)"
    )


def check_positive(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in POSITIVE_ARGUMENTS:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    check_device(parser, args)


def check_device(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--device`` is cpu or a GPU this machine has; otherwise stop at once (exit 2) with
    one line saying what to do, before any model is built."""
    if DEVICE.fullmatch(args.device) is None:
        parser.error(f"--device: {args.device!r} is not a device; use cpu, cuda or cuda:N")
    if args.device == "cpu":
        return
    from nexrl_engine.recipe_checks import device_problem

    problem = device_problem(args.device)
    if problem is not None:
        parser.error(f"--device: {problem}")


def common_argv(args: argparse.Namespace) -> list[str]:
    """The common options as a child process's arguments."""
    argv = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in (*POSITIVE_ARGUMENTS, "lr", "seed")]
    return argv if args.device == "cpu" else [*argv, f"--device={args.device}"]


DEVICE_KEYS = {"self-hosted": "backend.options.sampler.device"}
"""The recipe key that puts a NexRL backend on ``--device``, by ``backend.name`` (the
self-hosted workers take a GPU each by themselves); every other backend:
``backend.options.device`` (the in-process engine, the embedded Tinker or Weaver service)."""


def device_overrides(args: argparse.Namespace, backend: str) -> list[str]:
    """The recipe override that runs ``backend`` on ``--device``; none on cpu (the default)."""
    if args.device == "cpu":
        return []
    return [f"{DEVICE_KEYS.get(backend, 'backend.options.device')}={args.device}"]


def common_overrides(args: argparse.Namespace, out_dir: Path) -> list[str]:
    """Recipe overrides that give NexRL the run shape TRL gets: steps, one validation
    before step 1 and after step N, one checkpoint (the final weights), on-policy sampling
    at T=1, learning rate, seed."""
    return [
        f"schedule.steps={args.steps}",
        f"schedule.validate_every={args.steps}",
        f"schedule.checkpoint_every={args.steps}",
        f"task.val_size={args.val_size}",
        f"rollout.prompts_per_step={args.prompts_per_step}",
        f"rollout.group_size={args.group_size}",
        f"rollout.max_tokens={args.max_tokens}",
        "rollout.temperature=1.0",
        "rollout.val_temperature=1.0",
        "rollout.max_staleness=0",
        f"algorithm.learning_rate={args.lr}",
        f"seed={args.seed}",
        f"output.dir={out_dir}",
    ]


def finish_work_dir(args: argparse.Namespace, work: Path) -> None:
    """Keep the work dir when it was named or ``--keep`` asked for it, else remove it."""
    import shutil

    if args.work_dir or args.keep:
        print(f"work dir kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)


def pin_threads(threads: int) -> None:
    """Same thread count for torch in every process (set before torch does real work)."""
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = str(threads)
    import torch

    torch.set_num_threads(threads)


def seed_everything(seed: int) -> None:
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def median_after_first(values: Sequence[float]) -> float | None:
    """Median of every step but the first (all of them if there is only one): step 1 pays
    first-touch and warm-up costs."""
    tail = list(values[1:]) if len(values) > 1 else list(values)
    return statistics.median(tail) if tail else None


def fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def nexrl_training_items(config: Any, count: int) -> list[dict[str, Any]]:
    """The first ``count`` training items NexRL's data loader feeds, in its order, so TRL
    sees the same prompts in the same steps."""
    from nexrl_core.run.data import resolve_task

    task = resolve_task(config.task, config.seed, None)
    return [dict(item) for item, _task_id in task.train.take(0, count)]


def nexrl_step_metrics(metrics_path: Path) -> dict[str, Any]:
    """Per-step seconds, the median step split, training rewards and in-loop validation
    rewards of a finished run, read from its ``metrics.jsonl``."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    steps = sorted((row for row in rows if row.get("step", 0) >= 1 and "time/step_s" in row), key=lambda r: r["step"])
    return {
        "step_seconds": [float(row["time/step_s"]) for row in steps],
        "step_parts": {
            part: median_after_first([float(row[f"time/{part}_s"]) for row in steps if f"time/{part}_s" in row]) for part in STEP_PARTS
        },
        # per step, for `gpu_throughput`: sampled tokens and the rollout phase's seconds; the
        # trained rows, their completion tokens and the train phase's seconds
        "rollout_seconds": [float(row.get("time/rollout_s", 0.0)) for row in steps],
        "rollout_tokens": [float(row.get("rollout/response_tokens", 0.0)) for row in steps],
        "train_seconds": [float(row.get("time/train_s", 0.0)) for row in steps],
        "trained_rows": [float(row.get("datums/trained", 0.0)) for row in steps],
        "trained_completion_tokens": [float(row.get("datums/trained_tokens", 0.0)) for row in steps],
        "train_reward": [float(row["reward/mean"]) for row in steps if "reward/mean" in row],
        "datums_trained": sum(float(row.get("datums/trained", 0.0)) for row in steps),
        "inloop_val": {int(row["step"]): float(row["val/reward/mean"]) for row in rows if "val/reward/mean" in row},
    }


def nexrl_final_checkpoint(out_dir: Path, steps: int) -> str | None:
    """The engine checkpoint (nexrl-fsdp format) a run's backend, or its embedded service,
    wrote for step ``steps``: a directory under ``<out_dir>/backend`` whose name starts
    with ``step_<steps>``; None when there is none."""
    from nexrl_engine.checkpoint import MANIFEST_NAME

    wanted = f"step_{steps:06d}"
    manifests = [
        path
        for path in (out_dir / "backend").rglob(MANIFEST_NAME)
        if path.parent.name.startswith(wanted) and not path.parent.name[len(wanted) : len(wanted) + 1].isdigit()
    ]
    return str(max(manifests, key=lambda p: p.stat().st_mtime).parent) if manifests else None


def decode_raw(tokenizer: Any, token_ids: Sequence[int]) -> str:
    """Sampled ids as text with special tokens kept, the way NexRL's sampler shows them."""
    return str(tokenizer.decode(list(token_ids), skip_special_tokens=False, clean_up_tokenization_spaces=False))


def trl_grpo_config(args: Any, algorithm: Any, output_dir: Path) -> Any:
    """A ``GRPOConfig`` matching NexRL's recipe: one on-policy optimizer step per batch of
    ``prompts x group`` completions, no KL, constant learning rate, the recipe's AdamW
    settings, no gradient checkpointing (NexRL does not recompute)."""
    from trl import GRPOConfig

    batch = args.prompts_per_step * args.group_size
    return GRPOConfig(
        output_dir=str(output_dir),
        use_cpu=getattr(args, "device", "cpu") == "cpu",
        bf16=False,  # the model's own dtype decides; no autocast on either side
        gradient_checkpointing=False,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        generation_batch_size=batch,
        num_generations=args.group_size,
        num_iterations=1,
        max_completion_length=args.max_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=algorithm.beta1,
        adam_beta2=algorithm.beta2,
        adam_epsilon=algorithm.eps,
        weight_decay=algorithm.weight_decay,
        max_grad_norm=algorithm.grad_clip_norm,
        shuffle_dataset=False,  # NexRL's order, already shuffled by its data loader
        max_steps=args.steps,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=args.seed,
        dataloader_num_workers=0,
    )


def train_trl(model: Any, tokenizer: Any, dataset: Any, reward: Callable[..., list[float]], config: Any, final_dir: Path) -> dict[str, Any]:
    """Train with ``GRPOTrainer``, timing each step from ``on_step_begin`` to
    ``on_step_end`` (generation + reward + loss + backward + AdamW, no logging), and save
    the final model and tokenizer to ``final_dir``."""
    import torch
    import trl
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    on_gpu = not config.use_cpu and torch.cuda.is_available()
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.rewards: list[float] = []
            self._started = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            sync()
            self._started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            self.seconds.append(time.perf_counter() - self._started)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.rewards.append(float(logs["reward"]))

    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    # The rollout phase of each step (generation and rewards) and its tokens, for the
    # throughput table: TRL trains every row, prompt and completion tokens alike.
    rollout: dict[str, list[float]] = {"seconds": [], "completion_tokens": [], "train_tokens": [], "rows": []}
    generate = trainer._generate_and_score_completions

    def timed_generate(inputs: Any) -> Any:
        sync()
        began = time.perf_counter()
        output = generate(inputs)
        sync()
        rollout["seconds"].append(time.perf_counter() - began)
        completion = float(output["completion_mask"].sum())
        rollout["completion_tokens"].append(completion)
        rollout["train_tokens"].append(completion + float(output["prompt_mask"].sum()))
        rollout["rows"].append(float(output["completion_mask"].shape[0]))
        return output

    trainer._generate_and_score_completions = timed_generate
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    trainer.save_model(str(final_dir))
    tokenizer.save_pretrained(final_dir)
    return {
        "side": "trl",
        "trl_version": trl.__version__,
        "loss_type": config.loss_type,
        "scale_rewards": str(config.scale_rewards),
        "steps_done": int(trainer.state.global_step),
        "step_seconds": timer.seconds,
        "wall_s": wall,
        "train_reward": timer.rewards,
        "model_dir": str(final_dir),
        "checkpoint": None,
        "rollout_seconds": rollout["seconds"],
        "rollout_tokens": rollout["completion_tokens"],
        "train_seconds": [step - gen for step, gen in zip(timer.seconds, rollout["seconds"])],
        "trained_rows": rollout["rows"],
        "trained_tokens": rollout["train_tokens"],
        **gpu_peak_allocated(),
    }


def run_child(script: Path, side: str, argv: Sequence[str], work: Path, tag: str | None = None, device: str = "cpu") -> dict[str, Any]:
    """Run ``script --worker=<side>`` in a child process (cwd: this folder, so a
    ``task.agent`` module here is found); its output goes to ``<work>/<tag>.log`` and its
    result is the JSON it writes to ``<work>/<tag>_result.json``. On a GPU the result also
    holds the side's peak GPU memory (`GpuMemoryWatch`); for ``cuda:N`` the child sees only
    that GPU (``CUDA_VISIBLE_DEVICES=N``), as ``cuda``."""
    tag = tag or side
    result_path = work / f"{tag}_result.json"
    log_path = work / f"{tag}.log"
    env = dict(os.environ)
    if device.startswith("cuda:"):
        env["CUDA_VISIBLE_DEVICES"] = device.partition(":")[2]
        argv = ["--device=cuda" if arg == f"--device={device}" else arg for arg in argv]
    command = [sys.executable, str(script.resolve()), *argv, f"--worker={side}", f"--work-dir={work}"]
    print(f"[{tag}] training in a child process (log: {log_path}) ...", flush=True)
    started = time.perf_counter()
    with open(log_path, "w") as log, GpuMemoryWatch(device) as memory:
        process = subprocess.run(command, check=False, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=Path(__file__).parent)
    elapsed = time.perf_counter() - started
    if process.returncode != 0 or not result_path.exists():
        lines = log_path.read_text(errors="replace").splitlines()
        print(f"[{tag}] FAILED (exit {process.returncode}) after {elapsed:.1f} s; last lines of {log_path}:")
        print("\n".join("    " + line for line in lines[-25:]), flush=True)
        return {"side": side, "error": f"exit {process.returncode}", "log_tail": lines[-25:], "process_s": elapsed}
    result = json.loads(result_path.read_text())
    result["process_s"] = elapsed
    if memory.peak_gib is not None:
        result["gpu_peak_gib"] = memory.peak_gib
    print(f"[{tag}] done in {elapsed:.1f} s (process total, including start-up)", flush=True)
    return result


def evaluate_policy(
    weights_dir: str,
    checkpoint: str | None,
    conversations: Sequence[list[dict[str, str]]],
    score: Callable[[int, str], float],
    *,
    max_tokens: int,
    samples: int,
    seed: int,
    stop: tuple[int, ...] | None = None,
    device: str = "cpu",
) -> tuple[float, float, int, tuple[int, ...]]:
    """Mean reward of one model on ``conversations``: ``samples`` completions each at
    temperature 1 with a fixed seed (common random numbers across models), in fp32 on
    `nexrl_engine.Engine` on ``device``, scored by ``score(index, raw_text)``. Returns (mean,
    standard error, number of samples, stop ids); pass the stop ids of the first model to
    the others so every model stops alike."""
    from nexrl_core.chat.templates import render_chat
    from nexrl_engine import Engine, SamplingParams

    engine = Engine(model=weights_dir, seed=seed, device=device)
    if checkpoint is not None:
        engine.load_state(checkpoint, load_optimizer=False)
    stop = stop if stop is not None else engine.eos_token_ids
    prompts = [render_chat(engine.tokenizer, messages, tokenize=True) for messages in conversations]
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, stop=list(stop), seed=seed)
    results = engine.sample(prompts, params, num_samples=samples)
    rewards = [
        score(index, decode_raw(engine.tokenizer, sequence.tokens)) for index, result in enumerate(results) for sequence in result.sequences
    ]
    mean = statistics.fmean(rewards)
    stderr = (statistics.pvariance(rewards) / len(rewards)) ** 0.5 if len(rewards) > 1 else 0.0
    if device != "cpu":
        import torch

        del engine, results
        torch.cuda.empty_cache()  # the next side's processes get the card's memory back
    return mean, stderr, len(rewards), tuple(stop)


# --- on a GPU: memory and throughput ---------------------------------------------------------------


def gpu_peak_allocated() -> dict[str, float]:
    """``torch.cuda.max_memory_allocated`` of this process in GiB, when it used a GPU: the
    whole model for a side that trains in its own process (TRL, NexRL in-process), little
    for one whose model lives in a service or worker processes (see `GpuMemoryWatch`)."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    return {"torch_peak_gib": torch.cuda.max_memory_allocated() / 2**30}


class GpuMemoryWatch:
    """The most GPU memory in use on ``device`` while the block runs, above what was in use
    when it began: every process of a side together (the training process, a service,
    worker ranks, a sampler), their CUDA contexts and allocator caches included. Polls
    ``cudaMemGetInfo`` from this process every ``interval_s``; nothing on cpu."""

    def __init__(self, device: str, interval_s: float = 0.1) -> None:
        self.device = device
        self.interval_s = interval_s
        self.peak_gib: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _used(self) -> int:
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(self.device))
        return total - free

    def __enter__(self) -> GpuMemoryWatch:
        if self.device == "cpu":
            return self
        baseline = self._used()
        peak = [baseline]

        def poll() -> None:
            while not self._stop.wait(self.interval_s):
                peak[0] = max(peak[0], self._used())

        self._thread = threading.Thread(target=poll, name="gpu-memory-watch", daemon=True)
        self._thread.start()
        self._baseline, self._peak = baseline, peak
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self.peak_gib = (max(self._peak[0], self._used()) - self._baseline) / 2**30


def card(device: str, peak_tflops: float | None = None) -> tuple[str, float | None]:
    """The GPU's name and its peak dense bf16 FLOP/s (``peak_tflops`` if given, else from
    `PEAK_BF16_FLOPS`; None for a card not listed there)."""
    import torch

    name = torch.cuda.get_device_name(torch.device(device))
    if peak_tflops is not None:
        return name, peak_tflops * 1e12
    return name, next((flops for part, flops in PEAK_BF16_FLOPS.items() if part in name), None)


def gpu_throughput(result: dict[str, Any], params: int, prompt_tokens: float, peak_flops: float | None) -> dict[str, float | None]:
    """A side's throughput over steps 2..N (every step when there is one): rollout tokens/s
    (sampled tokens over the rollout phase's seconds), training tokens/s (prompt and
    completion tokens of every row trained, over the train phase's seconds), rows trained
    per step, and MFU = 6 x ``params`` x training tokens/s / ``peak_flops``.

    NexRL skips the rows of a group whose rewards are all equal (nothing to learn) and logs
    only their completion tokens, so its training tokens count ``prompt_tokens`` (the mean
    prompt length) per trained row; TRL trains every row. NexRL runs a group's shared prompt
    once per pass (`nexrl_engine.shared_prefix`), so it does fewer FLOPs than this counts. On
    a service backend, a step's queued training can show up in the next step's rollout wait.
    """

    def tail(values: list[float]) -> list[float]:
        return list(values[1:]) if len(values) > 1 else list(values)

    def rate(tokens: list[float], seconds: list[float]) -> float | None:
        total = sum(tail(seconds))
        return sum(tail(tokens)) / total if total > 0 else None

    rows = result.get("trained_rows", [])
    if "trained_tokens" in result:  # TRL
        trained = result["trained_tokens"]
    else:
        trained = [n * prompt_tokens + c for n, c in zip(rows, result.get("trained_completion_tokens", []))]
    train_rate = rate(trained, result.get("train_seconds", []))
    return {
        "step_s": median_after_first(result.get("step_seconds", [])),
        "rollout_tps": rate(result.get("rollout_tokens", []), result.get("rollout_seconds", [])),
        "train_tps": train_rate,
        "rows_per_step": statistics.fmean(tail(rows)) if rows else None,
        "mfu": 6 * params * train_rate / peak_flops if train_rate is not None and peak_flops else None,
    }


def mean_prompt_tokens(model: str, conversations: Sequence[list[dict[str, str]]]) -> float:
    """The mean length in tokens of the rendered prompts (what a row's prompt costs to train)."""
    from nexrl_core.chat.templates import render_chat
    from nexrl_engine.loading import load_tokenizer, resolve_model_dir

    tokenizer = load_tokenizer(resolve_model_dir(model))
    return statistics.fmean(len(render_chat(tokenizer, messages, tokenize=True)) for messages in conversations)


GPU_TABLE_HEADER = (
    "| s/step (median 2..N) | rollout tokens/s | training tokens/s | rows trained/step | GPU peak GiB (all its processes) "
    "| torch peak GiB (its training process) | MFU |"
)


def gpu_cells(result: dict[str, Any], numbers: dict[str, float | None]) -> str:
    """The cells of `GPU_TABLE_HEADER` for one side."""
    mfu = numbers["mfu"]
    return " | ".join(
        [
            fmt(numbers["step_s"]),
            fmt(numbers["rollout_tps"], 0),
            fmt(numbers["train_tps"], 0),
            fmt(numbers["rows_per_step"], 1),
            fmt(result.get("gpu_peak_gib"), 2),
            fmt(result.get("torch_peak_gib"), 2),
            "n/a" if mfu is None else f"{100 * mfu:.2f}%",
        ]
    )
