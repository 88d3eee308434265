"""What does going through the Tinker wire protocol cost?

Compares, side by side, the real ``tinker`` SDK talking to NexRL's local
Tinker-compatible service (``nexrl serve tinker`` in its own process on 127.0.0.1) with
the same `nexrl_engine.Engine` calls made in-process:

* ``forward_backward`` + ``optim_step`` (cross-entropy, LoRA) on B datums of T tokens;
* ``sample`` of N samples of exactly T new tokens (``stop=[]``) from one prompt;

at 1x16 (latency-bound) and 32x64 (compute-bound). Targets: service/engine <= 1.25
at 32x64, and <= 10 ms added per call at 1x16.

Run: ``python benchmarks/tinker_service_overhead.py [--reps N] [--rank R] [--in-process]``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("TINKER_API_KEY", "tml-benchmark")
os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The same OpenMP wait policy in every process of both sides: importing nexrl_fsdp (light,
# no torch) sets its default in os.environ before anything loads torch, and child
# processes inherit it.
import nexrl_engine  # noqa: E402, F401

from service_overhead import Row, print_table, serve, timed_pair  # noqa: E402 - after the environment is set


def start_server(data_dir: Path, in_process: bool) -> tuple[str, Callable[[], None]]:
    if in_process:
        from nexrl_tinker.testing import start_service

        service = start_service(data_dir)
        return service.base_url, service.stop
    return serve("tinker", data_dir, "/api/v1/healthz")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=30, help="timed repetitions per cell (median reported)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (0 = full fine-tuning)")
    parser.add_argument("--in-process", action="store_true", help="run the server in this process (shares the GIL)")
    args = parser.parse_args()

    import tinker
    import torch
    from tinker import types

    from nexrl_core.config.adamw import AdamWSettings
    from nexrl_engine.engine import Engine
    from nexrl_engine.types import Datum, SamplingParams

    shapes = [(1, 16), (32, 64)]
    prompt = [19, 20, 13, 21, 22, 31, 22, 24]
    adam = {"learning_rate": 1e-5}

    def tokens(b: int, t: int) -> list[list[int]]:
        return [[(5 * i + 3 * j) % 60 + 3 for j in range(t + 1)] for i in range(b)]

    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        url, stop = start_server(Path(tmp), args.in_process)
        try:
            with tinker.ServiceClient(base_url=url) as client:
                training = client.create_lora_training_client(base_model="nexrl-tiny", rank=args.rank).result()
                sampler = client.create_sampling_client(base_model="nexrl-tiny").result()
                engine = Engine(model="nexrl-tiny", lora={"rank": args.rank})
                base_engine = Engine(model="nexrl-tiny")
                for b, t in shapes:
                    seqs = tokens(b, t)
                    sdk_data = [
                        types.Datum(
                            model_input=types.ModelInput.from_ints(s[:-1]),
                            loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * t},
                        )
                        for s in seqs
                    ]
                    engine_data = [Datum(input_tokens=s[:-1], loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * t}) for s in seqs]

                    def sdk_train(sdk_data=sdk_data) -> None:
                        fb = training.forward_backward(sdk_data, "cross_entropy")
                        opt = training.optim_step(types.AdamParams(**adam))
                        fb.result()
                        opt.result()

                    def engine_train(engine_data=engine_data) -> None:
                        engine.forward_backward(engine_data, "cross_entropy")
                        engine.optim_step(AdamWSettings(**types.AdamParams(**adam).model_dump()))

                    def sdk_sample(b=b, t=t) -> None:
                        sampler.sample(types.ModelInput.from_ints(prompt), b, types.SamplingParams(max_tokens=t, stop=[], seed=1)).result()

                    def engine_sample(b=b, t=t) -> None:
                        base_engine.sample([prompt], SamplingParams(max_tokens=t, stop=[], seed=1), num_samples=b)

                    reps = args.reps if b * t <= 64 else max(5, args.reps // 2)
                    for name, via_sdk, direct in (
                        ("forward_backward+optim_step", sdk_train, engine_train),
                        ("sample", sdk_sample, engine_sample),
                    ):
                        service_ms, engine_ms = timed_pair(via_sdk, direct, reps, args.warmup)
                        calls = 2 if name.startswith("forward") else 1
                        rows.append((name, f"{b}x{t}", service_ms, engine_ms, calls))
        finally:
            stop()

    print_table(
        f"Tinker service overhead (torch {torch.__version__}, {torch.get_num_threads()} threads, LoRA rank {args.rank}, "
        f"server {'in-process' if args.in_process else 'subprocess'}, median of runs)",
        rows,
        "ratio <= 1.25 at 32x64; added latency <= 10 ms per call at 1x16.",
    )


if __name__ == "__main__":
    main()
