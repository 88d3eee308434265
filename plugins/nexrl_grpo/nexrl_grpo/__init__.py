"""NexRL GRPO plugin: group-relative advantage estimators, KL control and policy losses.

Importing the package (or its entry-point module ``nexrl_grpo.plugin``) loads no torch:
the registered specs name their factories as strings, and the math modules are imported
only when a run chooses one of their names.
"""

__version__ = "0.1.0"
