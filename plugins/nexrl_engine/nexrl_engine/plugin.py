"""Entry-point module of nexrl-engine: registers the tiny model's demo task and the
``inprocess`` backend.

Imports nothing heavy: the task and the backend are named by strings and loaded when
chosen; the backend's config class is torch-free.
"""

from __future__ import annotations

from nexrl_core.plugins.hookspecs import hookimpl
from nexrl_core.plugins.specs import BackendSpec, TaskSpec
from nexrl_core.training.backend import TEACHER_BACKEND
from nexrl_engine.inprocess.config import InProcessBackendConfig


@hookimpl
def nexrl_tasks() -> list[TaskSpec]:
    return [
        TaskSpec(
            name="addition",
            factory="nexrl_engine.tiny.task:AdditionTask",
            description="two-digit addition, exact-match reward (the shipped nexrl-tiny model's demo task)",
        )
    ]


@hookimpl
def nexrl_backends() -> list[BackendSpec]:
    """The engine inside the training process (no service, no HTTP); it can hold the
    recipe's teacher as a second, frozen engine."""
    return [
        BackendSpec(
            name="inprocess",
            factory="nexrl_engine.inprocess.backend:open_inprocess",
            config_class=InProcessBackendConfig,
            description="NexRL's engine in the training process (no service): fastest on one machine",
            capabilities=frozenset({TEACHER_BACKEND}),
        )
    ]
