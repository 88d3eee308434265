"""The ``self-hosted`` backend: FSDP workers (full fine-tuning or LoRA) driven over direct ZMQ, and a
sampler process whose weights come from the workers after each step.

`config` is light (no torch) so the plugin can register the backend and recipes can be
checked anywhere; `backend` loads torch and is imported only when a recipe picks it.
"""
