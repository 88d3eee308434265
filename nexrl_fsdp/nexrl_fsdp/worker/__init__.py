"""The FSDP worker ranks of the self-hosted backend: ``torchrun ... -m nexrl_fsdp.worker``.

`runtime.WorkerRank` registers with the API server, beats, and runs ops broadcast to it;
`actor.FsdpActor` holds the FSDP2-sharded model and runs them; `rows` turns a batch's
rows into the engine's datums.
"""
