"""NexRL metrics sinks: TensorBoard (a default sink), Weights & Biases, MLflow and Trackio.

Each sink is its own entry point (``nexrl.plugins``: ``tensorboard``, ``wandb``, ``mlflow``,
``trackio``) whose module imports no tracker SDK: a sink imports its SDK when a run picks
it, and a missing SDK refuses that run with the extra to install.
"""

__version__ = "0.1.0"
