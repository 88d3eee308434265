"""Build the shipped tiny model ``nexrl-tiny`` from nothing, reproducibly.

Run: ``python -m nexrl_engine.tiny.build`` (writes into the package's
``models/nexrl-tiny``), or ``python -m nexrl_engine.tiny.build --out DIR --steps N``.
``plugins/nexrl_engine/scripts/build_tiny_model.py`` is the same entry point as a script.

Steps, all on the CPU in a few minutes:

1. Train the byte-level BPE tokenizer (`nexrl_engine.tiny.tokenizer`).
2. Initialise a small Qwen2 (hidden 256, 4 layers, 4 heads, 2 KV heads, tied
   embeddings) from a fixed seed.
3. Pretrain it *through this package's own engine* (`Engine.forward_backward` with
   ``cross_entropy`` + `Engine.optim_step`) on two-digit addition in ChatML, with
   deliberately noisy labels: 60 % of answers are off by one (``a+b+1``). The model
   learns the format and a consistent wrong habit, so its starting reward is well
   above 0 and well below 1: room for RL to show learning within minutes.
   Loss only on the answer tokens and the closing ``<|im_end|>``.
4. Export as an HF directory, evaluate the exported model with the engine's sampler
   on held-out prompts (temperature 1 and greedy), and write ``build_manifest.json``
   with the sha256 of every file and the evaluation.

Threads, seeds and deterministic algorithms are pinned, so on the same torch build
and CPU a rebuild gives the same ``model.safetensors`` bit for bit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from nexrl_engine.tiny.addition import AdditionProblem, heldout_problems, sample_problems
from nexrl_engine.tiny.tokenizer import ENDOFTEXT, IM_END, build_tokenizer

__all__ = ["BuildReport", "BuildSettings", "build", "default_output_dir", "evaluate", "main", "sha256_of"]

MANIFEST_NAME = "build_manifest.json"
MODEL_NAME = "nexrl-tiny"

MODEL_CONFIG: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
}


@attrs.frozen(kw_only=True)
class BuildSettings:
    """Everything that determines the weights; recorded in the manifest."""

    steps: int = 1000
    batch_size: int = 64
    learning_rate: float = 1e-3
    warmup_steps: int = 50
    final_lr_fraction: float = 0.1
    """Cosine decay after warm-up ends at this fraction of ``learning_rate``; the decay lets
    the model settle on the noisy answer distribution instead of jittering around it."""
    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 1e-8
    weight_decay: float = 0.0
    noise_fraction: float = 0.6
    """Share of training answers replaced by ``a+b+1``."""
    seed: int = 0
    threads: int = 2


@attrs.frozen
class BuildReport:
    out_dir: str
    settings: dict[str, Any]
    parameters: int
    model_sha256: str
    tokenizer_sha256: str
    final_loss: float
    build_seconds: float
    evaluation: dict[str, Any] | None


def default_output_dir() -> Path:
    """The package's ``models/nexrl-tiny`` (what ``Engine(model="nexrl-tiny")`` loads)."""
    return Path(__file__).resolve().parent.parent / "models" / MODEL_NAME


def sha256_of(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _learning_rate(step: int, settings: BuildSettings) -> float:
    """Linear warm-up, then cosine decay to ``final_lr_fraction`` of the peak."""
    if step < settings.warmup_steps:
        return settings.learning_rate * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
    floor = settings.final_lr_fraction
    return settings.learning_rate * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


class _Prompts:
    """Chat-formatted prompt ids per problem, cached (the template is slow-ish to render)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[AdditionProblem, list[int]] = {}

    def __call__(self, problem: AdditionProblem) -> list[int]:
        ids = self.cache.get(problem)
        if ids is None:
            ids = list(self.tokenizer.apply_chat_template(problem.messages(), add_generation_prompt=True, tokenize=True, return_dict=False))
            self.cache[problem] = ids
        return ids


def _init_model(directory: Path, tokenizer: Any, seed: int) -> None:
    """Random Qwen2 from a fixed seed, saved with its tokenizer and generation config."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    config = Qwen2Config(vocab_size=len(tokenizer), bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id, **MODEL_CONFIG)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=pad_id, eos_token_id=[eos_id, pad_id], pad_token_id=pad_id, do_sample=True, temperature=1.0
    )
    from nexrl_engine.loading import save_hf_directory

    save_hf_directory(directory, model, tokenizer)


def _pretrain(engine: Any, prompts: _Prompts, settings: BuildSettings, log: Callable[[str], None]) -> float:
    """Supervised warm-up on noisy answers through the engine's own training path."""
    from nexrl_engine.types import Datum

    tokenizer = engine.tokenizer
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    rng = random.Random(settings.seed)
    loss_per_token = float("nan")
    for step in range(settings.steps):
        datums = []
        for problem in sample_problems(rng, settings.batch_size, "train"):
            total = problem.a + problem.b + (1 if rng.random() < settings.noise_fraction else 0)
            prompt = prompts(problem)
            answer = tokenizer.encode(str(total), add_special_tokens=False) + [eos_id]
            full = prompt + answer
            weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
            datums.append(Datum(input_tokens=full[:-1], loss_fn_inputs={"target_tokens": full[1:], "weights": weights}))
        result = engine.forward_backward(datums, "cross_entropy")
        engine.optim_step(
            learning_rate=_learning_rate(step, settings),
            beta1=settings.beta1,
            beta2=settings.beta2,
            eps=settings.eps,
            weight_decay=settings.weight_decay,
            grad_clip_norm=0.0,
        )
        loss_per_token = result.metrics["loss:sum"] / max(result.metrics["num_tokens:sum"], 1.0)
        if step % 100 == 0 or step == settings.steps - 1:
            log(f"step {step:4d}  loss/token {loss_per_token:.4f}")
    return loss_per_token


def evaluate(engine: Any, n_prompts: int = 200, seed: int = 1234, samples_per_prompt: int = 4) -> dict[str, Any]:
    """Held-out exact-match reward: mean over ``samples_per_prompt`` samples at temperature
    1 (the headline starting reward) and greedy accuracy."""
    from nexrl_engine.types import SamplingParams

    problems = heldout_problems(n_prompts)
    prompts = _Prompts(engine.tokenizer)
    prompt_ids = [prompts(problem) for problem in problems]

    def score(params: SamplingParams, n: int) -> float:
        results = engine.sample(prompt_ids, params, num_samples=n)
        total = 0.0
        for problem, result in zip(problems, results):
            for sequence in result.sequences:
                text = engine.tokenizer.decode(sequence.tokens, skip_special_tokens=True)
                total += problem.reward(text)
        return total / (len(problems) * n)

    return {
        "heldout_prompts": len(problems),
        "sampled_reward_t1": score(SamplingParams(temperature=1.0, max_tokens=8, seed=seed), samples_per_prompt),
        "samples_per_prompt": samples_per_prompt,
        "greedy_accuracy": score(SamplingParams(temperature=0.0, max_tokens=8, seed=seed), 1),
    }


def build(
    out_dir: str | Path | None = None,
    settings: BuildSettings | None = None,
    *,
    eval_prompts: int = 200,
    log: Callable[[str], None] | None = None,
) -> BuildReport:
    """Build the tiny model into ``out_dir`` (replaced if it exists) and return a report."""
    import torch

    from nexrl_engine.engine import Engine

    settings = settings or BuildSettings()
    log = log or (lambda message: print(message, file=sys.stderr, flush=True))
    out = Path(out_dir) if out_dir is not None else default_output_dir()
    started = time.perf_counter()
    previous_threads = torch.get_num_threads()
    previous_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(settings.threads)
    torch.use_deterministic_algorithms(True)
    try:
        with tempfile.TemporaryDirectory(prefix="nexrl-tiny-init-") as init_dir:
            tokenizer = build_tokenizer(seed=settings.seed)
            _init_model(Path(init_dir), tokenizer, settings.seed)
            engine = Engine(model=init_dir, seed=settings.seed)
            log(f"initialised {engine.num_parameters():,} parameters; pretraining {settings.steps} steps")
            final_loss = _pretrain(engine, _Prompts(engine.tokenizer), settings, log)
            out.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=str(out.parent)))
            try:
                engine.export_hf(staging)
                # mkdtemp makes a private directory; the shipped model must be world-readable.
                os.chmod(staging, 0o755)
                for path in staging.iterdir():
                    os.chmod(path, 0o644)
                if out.exists():
                    shutil.rmtree(out)
                os.replace(staging, out)
            finally:
                if staging.exists():
                    shutil.rmtree(staging)
        parameters = engine.num_parameters()
        del engine
        evaluation = None
        if eval_prompts > 0:
            evaluation = evaluate(Engine(model=str(out), seed=settings.seed), eval_prompts)
            log(f"held-out evaluation: {evaluation}")
    finally:
        torch.set_num_threads(previous_threads)
        torch.use_deterministic_algorithms(previous_deterministic)

    seconds = time.perf_counter() - started
    files = {path.name: sha256_of(path) for path in sorted(out.iterdir()) if path.is_file() and path.name != MANIFEST_NAME}
    import transformers

    manifest = {
        "name": MODEL_NAME,
        "builder": "python -m nexrl_engine.tiny.build",
        "settings": attrs.asdict(settings),
        "model_config": MODEL_CONFIG,
        "parameters": parameters,
        "final_train_loss_per_token": final_loss,
        "files_sha256": files,
        "evaluation": evaluation,
        "build_seconds": round(seconds, 1),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "task": "two-digit addition a+b= (nexrl_engine.tiny.addition), exact-match reward",
    }
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return BuildReport(
        out_dir=str(out),
        settings=attrs.asdict(settings),
        parameters=parameters,
        model_sha256=files["model.safetensors"],
        tokenizer_sha256=files["tokenizer.json"],
        final_loss=final_loss,
        build_seconds=seconds,
        evaluation=evaluation,
    )


def main(argv: Sequence[str] | None = None) -> int:
    defaults = BuildSettings()
    parser = argparse.ArgumentParser(prog="python -m nexrl_engine.tiny.build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help=f"output directory (default: {default_output_dir()})")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="pretraining steps")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--threads", type=int, default=defaults.threads, help="torch threads (pinned for reproducibility)")
    parser.add_argument("--eval-prompts", type=int, default=200, help="held-out prompts to evaluate on (0 = skip)")
    args = parser.parse_args(argv)
    settings = attrs.evolve(defaults, steps=args.steps, seed=args.seed, threads=args.threads)
    report = build(args.out, settings, eval_prompts=args.eval_prompts)
    print(json.dumps(attrs.asdict(report), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
