"""The ``inprocess`` backend: the nexrl-engine engine inside the training process.

No service and no HTTP between the loop and the model. `config` is light (no torch) so
that the plugin can register the backend and recipes can be checked anywhere; `holder`
(`EngineHolder`) and `backend` (`open_inprocess`) load torch and are imported only
when a recipe picks ``backend.name: inprocess``.
"""
