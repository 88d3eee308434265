"""Entry-point module of nexrl-fsdp: registers the tiny model's demo task.

Imports nothing heavy; the task module is named by a string and loaded when chosen.
"""

from __future__ import annotations

from nexrl_core.hookspecs import hookimpl
from nexrl_core.specs import TaskSpec


@hookimpl
def nexrl_tasks() -> list[TaskSpec]:
    return [
        TaskSpec(
            name="addition",
            factory="nexrl_fsdp.tiny.task:AdditionTask",
            description="two-digit addition, exact-match reward (the shipped nexrl-tiny model's demo task)",
        )
    ]
