"""The remote-API backend: a service holder samples and trains, a datum trainer drives it.

`RemoteApiTrainer` turns a step's trajectories into datums and one optimizer step;
`HolderBackend` makes any service holder plus such a trainer a
`nexrl_core.backend.Backend`; `remote_backend` opens one from a recipe, starting the
registered local service for the run when no ``base_url`` is given.
"""
