"""The remote-API backend: a service holder samples and trains, a registered trainer drives it.

`remote_backend` opens one from a recipe, starting the registered local service for the
run when no ``base_url`` is given. What it is built from lives in the core, shared with
every other backend over a holder: `nexrl_core.training.holder_backend.HolderBackend`,
`nexrl_core.training.trainer.build_trainer` and `nexrl_core.training.holder_trainer.HolderTrainer`.
"""
