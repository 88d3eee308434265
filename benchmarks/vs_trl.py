"""NexRL's quickstart on each of its backends against TRL's ``GRPOTrainer``: same model,
task and settings.

One invocation trains the shipped tiny model (``nexrl-tiny``) on the two-digit addition
task once per side, each in its own child process of this script:

* (a) NexRL, one side per backend: the built-in quickstart recipe through
  `nexrl_core.run.loop.run_training` (GRPO advantages, ``importance_sampling`` loss, full
  fine-tuning) with the shared settings below as overrides, on ``remote_api`` (the
  quickstart's own backend: the real ``tinker`` SDK against the embedded local
  Tinker-compatible service in its own process) and on ``inprocess`` (the engine inside
  the training process: no service, no HTTP);
* (b) TRL: ``GRPOTrainer`` on a copy of the same model directory and tokenizer, the same
  training prompts in the same order, the same exact-match reward.

Shared: model, tokenizer, chat template, reward, prompts per step, group size, max new
tokens, temperature 1, learning rate, seed, and the AdamW settings NexRL's recipe uses
(betas, eps, weight decay, grad-clip norm, constant learning rate). Both take exactly one
optimizer step per batch of ``prompts x group`` completions, on-policy.

It prints seconds per step and the validation reward after N steps for every side, side
by side, with the ratios NexRL/TRL. Targets: NexRL s/step <= 1.0x TRL's, and NexRL's final reward >= TRL's.
The exit status is 0 whatever the verdict: this is a benchmark, not a test.

Measured:

* s/step: median over steps 2..N (step 1 pays first-touch and warm-up costs). NexRL:
  ``time/step_s`` from ``metrics.jsonl`` (rollout + train + weight sync, without
  validation and checkpoints). TRL: wall time from ``on_step_begin`` to ``on_step_end``
  of a ``TrainerCallback`` (generation + reward + loss + backward + optimizer, without
  logging).
* reward: ONE evaluation function for every model (the untrained start, NexRL's final
  weights, TRL's final weights): the first ``--val-size`` held-out problems, sampled with
  `nexrl_engine.Engine` at temperature 1 with the same seed (common random numbers), the
  same stop tokens and ``--max-tokens``, ``--eval-samples`` samples per problem, exact
  match, mean. NexRL's final weights are the run's ``final_model`` (a plain HF directory),
  loaded into a fresh engine. NexRL's own in-loop ``val/reward/mean`` (one sample
  per problem) is printed as a cross-check only.

``--device cuda`` (or ``cuda:N``) runs every side on that GPU: NexRL's embedded service, engine
or sampler and workers (`grpo_sides.device_overrides`), TRL without ``use_cpu``, and the
evaluation; it then also prints each side's rollout and training tokens/s, peak GPU memory
and MFU (`grpo_sides.gpu_throughput`). A device this machine lacks stops the script at once.

Run: ``python benchmarks/vs_trl.py [--steps 10] [--prompts-per-step 16] [--group-size 8]
[--max-tokens 8] [--lr 1e-4] [--val-size 200] [--seed 0] [--only SIDE ...]
[--device cpu|cuda|cuda:N]`` with sides ``remote_api``, ``inprocess``, ``self-hosted`` and ``trl``.
Needs ``trl`` installed under the torch pin: ``pip install -c constraints.txt trl``.
"""

from __future__ import annotations

import argparse
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
from grpo_sides import (
    add_common_arguments,
    check_positive,
    common_argv,
    common_overrides,
    decode_raw,
    evaluate_policy,
    finish_work_dir,
    fmt,
    median_after_first,
    nexrl_final_checkpoint,
    nexrl_step_metrics,
    nexrl_training_items,
    pin_threads,
    ratio,
    run_child,
    seed_everything,
    train_trl,
    trl_grpo_config,
)

MODEL_NAME = "nexrl-tiny"
REPO = Path(__file__).resolve().parents[1]
NEXRL_SIDES = ("remote_api", "inprocess", "self-hosted")
"""NexRL's backends, each run through the quickstart recipe with ``backend.name`` set.
Every side's final weights are evaluated from the run's ``final_model`` directory."""
SIDES = (*NEXRL_SIDES, "trl")
SPEED_TARGET = 1.0
"""NexRL s/step must be at most this multiple of TRL's."""


def model_dir() -> Path:
    from nexrl_engine.loading import resolve_model_dir

    return resolve_model_dir(MODEL_NAME)


BACKEND_RECIPES = {"inprocess": "quickstart_inprocess.yaml", "self-hosted": "quickstart_fsdp.yaml"}
"""The recipe whose ``backend.options`` a side uses: what a user runs on that backend."""


def quickstart_config(args: argparse.Namespace, out_dir: Path, backend: str = "remote_api") -> Any:
    """The built-in quickstart recipe on ``backend`` (with the options of that backend's
    own quickstart recipe) and the shared settings as overrides."""
    from importlib.resources import as_file, files

    from nexrl_core.config import load_config
    from nexrl_core.config.load import read_recipe

    overrides = [f"model.name={MODEL_NAME}", *common_overrides(args, out_dir)]
    if backend != "remote_api":
        options = read_recipe(REPO / "recipes" / BACKEND_RECIPES[backend])["backend"].get("options", {})
        overrides += [f"backend.name={backend}", f"backend.options={json.dumps(options)}"]
    overrides += shared.device_overrides(args, backend)
    with as_file(files("nexrl_core").joinpath("recipes", "quickstart.yaml")) as recipe:
        return load_config(recipe, overrides)


def training_items(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The training items NexRL's data loader feeds steps 1..N, in its order."""
    config = quickstart_config(args, Path(tempfile.gettempdir()) / "nexrl_vs_trl_unused")
    taken = nexrl_training_items(config, args.steps * args.prompts_per_step)
    return [{"a": int(item["a"]), "b": int(item["b"])} for item in taken]


# --- (a) NexRL -----------------------------------------------------------------------------------


def run_nexrl(args: argparse.Namespace, work: Path, backend: str) -> dict[str, Any]:
    import logging

    from nexrl_core.run.loop import run_training

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("nexrl").setLevel(logging.INFO)
    out_dir = work / f"nexrl_{backend}_run"
    config = quickstart_config(args, out_dir, backend)
    seed_everything(args.seed)
    started = time.perf_counter()
    summary = run_training(config, overwrite=True, progress_bar=False)
    wall = time.perf_counter() - started

    # The final weights: the run's final_model (a plain HF directory every backend that can
    # export writes), else the engine checkpoint of step N on the shipped base model.
    final_model = out_dir / "final_model"
    if (final_model / "config.json").is_file():
        weights, checkpoint = str(final_model), None
    else:
        checkpoint = nexrl_final_checkpoint(out_dir, args.steps)
        weights = MODEL_NAME if checkpoint is not None else None
    return {
        "side": backend,
        "steps_done": summary.steps,
        **nexrl_step_metrics(summary.metrics_path),
        "wall_s": wall,
        "model_dir": weights,
        "checkpoint": checkpoint,
        "metrics_path": str(summary.metrics_path),
        **shared.gpu_peak_allocated(),
    }


# --- (b) TRL -------------------------------------------------------------------------------------


def run_trl(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nexrl_engine.tiny.addition import AdditionProblem

    recipe = quickstart_config(args, work / "unused").algorithm
    source = work / "trl_start_model"
    shutil.copytree(model_dir(), source, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = "<|endoftext|>"
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)

    items = training_items(args)
    dataset = Dataset.from_list([{"prompt": AdditionProblem(i["a"], i["b"]).messages(), "a": i["a"], "b": i["b"]} for i in items])

    def exact_match(prompts: list, completions: list, completion_ids: list, a: list, b: list, **_: Any) -> list[float]:
        # Score the raw sampled text (as NexRL's sampler shows it) with the task's reward.
        texts = [decode_raw(tokenizer, ids) for ids in completion_ids]
        return [AdditionProblem(int(x), int(y)).reward(text) for x, y, text in zip(a, b, texts)]

    config = trl_grpo_config(args, recipe, work / "trl_out")
    return train_trl(model, tokenizer, dataset, exact_match, config, work / "trl_final_model")


# --- evaluation (one function for every model) ---------------------------------------------------


def evaluate(
    weights_dir: str, checkpoint: str | None, args: argparse.Namespace, stop: tuple[int, ...] | None = None
) -> tuple[float, float, int, tuple[int, ...]]:
    """Mean exact-match reward of the first ``val_size`` held-out problems, sampled at
    temperature 1 with a fixed seed; returns (mean, standard error, samples, stop ids)."""
    from nexrl_engine.tiny.addition import heldout_problems

    problems = heldout_problems(args.val_size)
    return evaluate_policy(
        weights_dir,
        checkpoint,
        [problem.messages() for problem in problems],
        lambda index, text: problems[index].reward(text),
        max_tokens=args.max_tokens,
        samples=args.eval_samples,
        seed=args.seed,
        stop=stop,
        device=args.device,
    )


# --- orchestration -------------------------------------------------------------------------------


def run_side(side: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Train one side in a child process; its output goes to ``<work>/<side>.log``."""
    return run_child(Path(__file__), side, common_argv(args), work, device=args.device)


def report(args: argparse.Namespace, results: dict[str, dict[str, Any]], evals: dict[str, Any]) -> None:
    sides = [side for side in SIDES if side in results]
    nexrl_sides = [side for side in sides if side in NEXRL_SIDES]
    speed = {side: median_after_first(results[side]["step_seconds"]) if "step_seconds" in results[side] else None for side in sides}
    reward = {side: evals[side][0] if side in evals else None for side in sides}
    stderr = {side: evals[side][1] if side in evals else None for side in sides}
    start = evals.get("start")
    n_eval = start[2] if start else args.val_size * args.eval_samples

    def row(label: str, values: dict[str, str], ratios: dict[str, str] | None = None, target: str = "") -> None:
        cells = [values.get(side, "n/a") for side in sides]
        cells += [(ratios or {}).get(side, "") for side in nexrl_sides] if "trl" in sides else []
        print(f"| {label} | " + " | ".join(cells) + (f" | {target} |" if "trl" in sides else " |"))

    print()
    print("## NexRL's backends vs TRL GRPOTrainer")
    print(
        f"model {MODEL_NAME}, addition task, {args.steps} steps x {args.prompts_per_step} prompts x {args.group_size} "
        f"samples, max_tokens {args.max_tokens}, lr {args.lr}, seed {args.seed}, {args.threads} torch threads"
    )
    print(
        f"reward = mean exact match on the first {args.val_size} held-out problems x {args.eval_samples} samples "
        f"(T=1, seed {args.seed}, same Engine sampler for every model; n={n_eval})"
    )
    print()
    headers = [f"NexRL {side}" if side in NEXRL_SIDES else "TRL" for side in sides]
    if "trl" in sides:
        headers += [f"{side}/TRL" for side in nexrl_sides] + ["target"]
    print("| | " + " | ".join(headers) + " |")
    print("|" + "---|" * (len(headers) + 1))
    row(
        "s/step (median, steps 2..N)",
        {side: fmt(speed[side]) for side in sides},
        {side: fmt(ratio(speed[side], speed.get("trl")), 2) for side in nexrl_sides},
        f"<= {SPEED_TARGET:.2f}",
    )
    row(
        "final val reward",
        {side: f"{fmt(reward[side])} ± {fmt(stderr[side])}" for side in sides},
        {side: fmt(ratio(reward[side], reward.get("trl")), 2) for side in nexrl_sides},
        ">= 1.00",
    )
    start_text = f"{fmt(start[0])} ± {fmt(start[1])}" if start else "n/a"
    row("start val reward (untrained)", {side: start_text for side in sides})
    row(
        "training call wall s (see note)",
        {side: fmt(results[side].get("wall_s"), 1) for side in sides},
        {side: fmt(ratio(results[side].get("wall_s"), results.get("trl", {}).get("wall_s")), 2) for side in nexrl_sides},
    )
    row(
        "child process wall s (incl. imports, set-up)",
        {side: fmt(results[side].get("process_s"), 1) for side in sides},
        {side: fmt(ratio(results[side].get("process_s"), results.get("trl", {}).get("process_s")), 2) for side in nexrl_sides},
    )
    print()

    for side in sides:
        result = results[side]
        if "error" in result:
            print(f"{side}: did not run ({result['error']}); see {side}.log in the work dir")
            continue
        print(f"{side}: every step's seconds: " + " ".join(f"{s:.3f}" for s in result["step_seconds"]))
        if result.get("train_reward"):
            print(f"{side}: training reward per step: " + " ".join(f"{r:.3f}" for r in result["train_reward"]))
        if "step_parts" in result:
            parts = result["step_parts"]
            print(
                f"{side}: step split (median, steps 2..N): "
                + ", ".join(f"{key} {fmt(parts.get(key))} s" for key in ("rollout", "train", "sync"))
            )
        if result.get("inloop_val"):
            print(
                f"{side}: cross-check, its own in-loop val/reward/mean (same held-out items, T=1, 1 sample each): "
                + ", ".join(f"step {step}: {value:.3f}" for step, value in sorted(result["inloop_val"].items(), key=lambda kv: int(kv[0])))
            )
        if side in NEXRL_SIDES:
            found = f"from {result.get('checkpoint') or result.get('model_dir')}" if side in evals else "not evaluated: no final model"
            print(f"{side}: final reward {found}")
    if "trl" in evals:
        trl_ = results["trl"]
        print(
            f"trl: final reward evaluated from the saved model {trl_.get('model_dir')} (TRL {trl_.get('trl_version')}, "
            f"loss_type={trl_.get('loss_type')}, scale_rewards={trl_.get('scale_rewards')})"
        )
    print(
        "note: NexRL s/step = time/step_s (rollout + train + weight sync, no validation/checkpoint); TRL s/step = "
        "on_step_begin..on_step_end (generation + reward + loss + backward + AdamW)."
    )
    print(
        "note: training call wall = run_training() for NexRL (includes opening the backend, e.g. starting the "
        "embedded service, validation before step 1 and after step N, and the final checkpoint) and "
        "trainer.train() for TRL (steps only)."
    )
    print(
        "note: the second vCPU of this machine is noisy (2-thread runs vary up to ~3x minute to minute, "
        "cpu-measurements.md §0); rerun before trusting a small s/step difference."
    )
    print()

    verdicts = []
    for side in nexrl_sides:
        r_speed = ratio(speed[side], speed.get("trl"))
        if r_speed is None:
            verdicts.append(f"{side} speed: NOT MEASURED")
        else:
            verdicts.append(
                f"{side} speed: {'PASS' if r_speed <= SPEED_TARGET else 'FAIL'} ({r_speed:.2f}x, target <= {SPEED_TARGET:.2f}x)"
            )
        if reward[side] is None or reward.get("trl") is None:
            verdicts.append(f"{side} reward: NOT MEASURED")
        else:
            noise = ((stderr[side] or 0.0) ** 2 + (stderr["trl"] or 0.0) ** 2) ** 0.5
            diff = reward[side] - reward["trl"]
            within = " (difference within 1 standard error)" if abs(diff) <= noise else ""
            verdicts.append(
                f"{side} reward: {'PASS' if diff >= 0 else 'FAIL'} ({reward[side]:.3f} vs TRL {reward['trl']:.3f}, "
                f"diff {diff:+.3f} ± {noise:.3f}{within})"
            )
    print("VERDICT: " + "; ".join(verdicts))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser, steps=10, prompts=16, group=8, val_size=200)
    parser.add_argument("--only", choices=SIDES, nargs="+", help="run only these sides")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_positive(parser, args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    pin_threads(args.threads)
    if args.worker:
        work = Path(args.work_dir)
        result = run_trl(args, work) if args.worker == "trl" else run_nexrl(args, work, args.worker)
        (work / f"{args.worker}_result.json").write_text(json.dumps(result, indent=2))
        return 0

    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="nexrl_vs_trl_"))
    work.mkdir(parents=True, exist_ok=True)
    import torch

    print(
        f"python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"{args.threads} torch threads per process; work dir {work}",
        flush=True,
    )
    sides = [side for side in SIDES if side in args.only] if args.only else list(SIDES)
    results = {side: run_side(side, args, work) for side in sides}

    print("evaluating (same sampler, prompts, seed and stop tokens for every model) ...", flush=True)
    evals: dict[str, tuple[float, float, int, tuple[int, ...]]] = {}
    start = evaluate(MODEL_NAME, None, args)
    evals["start"] = start
    stop = start[3]
    for side in sides:
        result = results[side]
        if "error" in result or not result.get("model_dir"):
            continue
        evals[side] = evaluate(result["model_dir"], result.get("checkpoint"), args, stop=stop)
    report(args, results, evals)
    if args.device != "cpu":
        gpu_report(args, results)
    finish_work_dir(args, work)
    return 0


def gpu_report(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> None:
    """Per side on the GPU: s/step, rollout and training tokens/s, rows trained per step,
    peak GPU memory and MFU (`grpo_sides.gpu_throughput`)."""
    from transformers import AutoConfig

    from nexrl_engine.tiny.addition import AdditionProblem

    card, peak_flops = shared.card(args.device, args.peak_tflops)
    prompts = [AdditionProblem(item["a"], item["b"]).messages() for item in training_items(args)]
    prompt_tokens = shared.mean_prompt_tokens(MODEL_NAME, prompts)
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir())).parameters())
    peak = f"MFU against {peak_flops / 1e12:.0f} TFLOP/s dense bf16" if peak_flops else "peak FLOP/s unknown: pass --peak-tflops"
    print()
    print(f"## Throughput on {card} ({MODEL_NAME}, {params:,} parameters; {peak})")
    print(
        "steps 2..N; rollout tokens/s = sampled tokens / rollout phase s; training tokens/s = prompt + completion tokens "
        f"of the rows trained / train phase s (NexRL: {prompt_tokens:.1f} prompt tokens per row, the mean); "
        "MFU = 6 x parameters x training tokens/s / peak"
    )
    print()
    print("| side " + shared.GPU_TABLE_HEADER)
    print("|---|---|---|---|---|---|---|---|")
    for side in SIDES:
        if side in results and "error" not in results[side]:
            numbers = shared.gpu_throughput(results[side], params, prompt_tokens, peak_flops)
            print(f"| {'TRL' if side == 'trl' else 'NexRL ' + side} | {shared.gpu_cells(results[side], numbers)} |")


if __name__ == "__main__":
    sys.exit(main())
