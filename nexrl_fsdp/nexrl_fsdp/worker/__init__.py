"""The FSDP worker ranks of the self-hosted backend: ``python -m nexrl_fsdp.worker``.

`runtime.WorkerRank` registers with the API server, beats, and runs ops broadcast to it;
`actor.FsdpActor` holds the FSDP2-sharded model (full fine-tuning or LoRA) and runs them;
`rows` turns a batch's rows into the engine's datums; `loopback` starts one machine's
ranks with every socket on 127.0.0.1 (torchrun starts them across machines).
"""
