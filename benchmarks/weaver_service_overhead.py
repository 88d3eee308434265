"""What does going through the Weaver wire protocol cost?

Compares, side by side, the real ``nex-weaver`` SDK talking to NexRL's local
Weaver-compatible service (``nexrl serve weaver`` in its own process on 127.0.0.1)
with the same `nexrl_engine.Engine` calls made in-process:

* ``forward_backward`` + ``optim_step`` (cross-entropy, LoRA) on B datums of T tokens;
* ``sample`` of N samples of exactly T new tokens from one prompt (a stop string that
  never occurs, on both sides: the SDK cannot send Tinker's ``stop=[]``, "not even EOS");

at 1x16 (latency-bound) and 32x64 (compute-bound). Targets: service/engine <= 1.25
at 32x64, and <= 15 ms added per call at 1x16 (the SDK's operations are submitted
and then polled; the service answers a quick one in its submission).

Run: ``python benchmarks/weaver_service_overhead.py [--reps N] [--rank R] [--transport http-binary]``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import nexrl_engine  # noqa: E402, F401 - the same OpenMP wait policy in every process

from service_overhead import Row, print_table, serve, timed_pair  # noqa: E402 - after the environment is set


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=30, help="timed repetitions per cell (median reported)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (0 = full fine-tuning)")
    parser.add_argument("--transport", choices=["default", "http-binary"], default="default")
    args = parser.parse_args()

    import torch
    import weaver
    from weaver import types

    from nexrl_engine.engine import Engine
    from nexrl_engine.types import Datum, SamplingParams

    shapes = [(1, 16), (32, 64)]
    prompt = [19, 20, 13, 21, 22, 31, 22, 24]
    never = ["\x00never\x00"]
    adam = {"learning_rate": 1e-5, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 0.0}

    def tokens(b: int, t: int) -> list[list[int]]:
        return [[(5 * i + 3 * j) % 60 + 3 for j in range(t + 1)] for i in range(b)]

    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        url, stop = serve("weaver", Path(tmp), "/api/v1/healthz")
        client = weaver.ServiceClient(base_url=url, tensor_transport=args.transport)
        try:
            client.connect()
            if args.rank > 0:
                training = client.create_model(base_model="nexrl-tiny", lora_config=types.LoraConfig(rank=args.rank))
            else:
                training = client.create_model(base_model="nexrl-tiny", training_mode="full_ft")
            sampler = client.create_sampling_client(base_model="nexrl-tiny")
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
                    fb = training.forward_backward(sdk_data, "cross_entropy", wait=False)
                    opt = training.optim_step(types.AdamParams(**adam), wait=False)
                    fb.result()
                    opt.result()

                def engine_train(engine_data=engine_data) -> None:
                    engine.forward_backward(engine_data, "cross_entropy")
                    engine.optim_step(adam)

                def sdk_sample(b=b, t=t) -> None:
                    sampler.sample(
                        prompt=types.ModelInput.from_ints(prompt),
                        num_samples=b,
                        sampling_params=types.SamplingParams(max_tokens=t, stop=list(never), seed=1),
                    )

                def engine_sample(b=b, t=t) -> None:
                    base_engine.sample([prompt], SamplingParams(max_tokens=t, stop=never, seed=1), num_samples=b)

                reps = args.reps if b * t <= 64 else max(5, args.reps // 2)
                for name, via_sdk, direct in (
                    ("forward_backward+optim_step", sdk_train, engine_train),
                    ("sample", sdk_sample, engine_sample),
                ):
                    service_ms, engine_ms = timed_pair(via_sdk, direct, reps, args.warmup)
                    calls = 2 if name.startswith("forward") else 1
                    rows.append((name, f"{b}x{t}", service_ms, engine_ms, calls))
        finally:
            client.close()
            stop()

    print_table(
        f"Weaver service overhead (torch {torch.__version__}, {torch.get_num_threads()} threads, LoRA rank {args.rank}, "
        f"{args.transport} tensors, server subprocess, median of runs)",
        rows,
        "ratio <= 1.25 at 32x64; added latency <= 15 ms per call at 1x16.",
    )


if __name__ == "__main__":
    main()
