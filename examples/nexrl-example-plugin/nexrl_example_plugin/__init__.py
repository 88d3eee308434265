"""An example NexRL plugin: a median-baseline advantage estimator."""

__version__ = "0.1.0"
