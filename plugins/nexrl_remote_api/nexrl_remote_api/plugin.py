"""Entry-point module of nexrl-remote-api: registers the ``remote_api`` backend.

Imports only the config class; the backend itself is named by a ``"module:attr"``
string and loaded when a recipe picks it.
"""

from __future__ import annotations

from nexrl_core.plugins.hookspecs import hookimpl
from nexrl_core.plugins.specs import BackendSpec
from nexrl_core.training.backend import TEACHER_BACKEND
from nexrl_remote_api.remote_backend import RemoteApiBackendConfig


@hookimpl
def nexrl_backends() -> list[BackendSpec]:
    """Any registered service holder, against ``base_url`` or an embedded local service."""
    return [
        BackendSpec(
            name="remote_api",
            factory="nexrl_remote_api.remote_backend:open_remote_api",
            config_class=RemoteApiBackendConfig,
            description="A service holder (Tinker, Weaver, ...) on a hosted API or a local service started for the run",
            # a teacher, where the holder scores with one (HolderBackend refuses it for a holder that does not)
            capabilities=frozenset({TEACHER_BACKEND}),
        )
    ]
