"""Entry-point module of nexrl-fsdp: registers the ``self-hosted`` backend, the
``direct-zmq`` transport, the workers' API server (``nexrl serve workers``), the
``local`` placer and the engines a local service trains on with ``--workers N`` (with how
their ranks are started by hand, `nexrl_fsdp.worker.arguments.RANK_COMMAND`).

Imports nothing heavy: the backend is named by a string and loaded when chosen; its config
class is torch-free.
"""

from __future__ import annotations

from nexrl_core.http.serving import ServeOptions
from nexrl_core.plugins.hookspecs import hookimpl
from nexrl_core.plugins.specs import BackendSpec, GroupEngineSpec, PlacerSpec, ServiceSpec, TransportSpec
from nexrl_core.training.backend import TEACHER_BACKEND
from nexrl_core.training.placement import LOCAL_PLACEMENT
from nexrl_fsdp.direct_zmq.options import DirectZmqOptions
from nexrl_fsdp.local_placer import LocalPlacerOptions
from nexrl_fsdp.selfhosted.config import SelfHostedBackendConfig
from nexrl_fsdp.worker.arguments import RANK_COMMAND


@hookimpl
def nexrl_backends() -> list[BackendSpec]:
    """Self-hosted FSDP workers and their sampler process."""
    return [
        BackendSpec(
            name="self-hosted",
            factory="nexrl_fsdp.selfhosted.backend:open_self_hosted",
            config_class=SelfHostedBackendConfig,
            description="FSDP2 workers under torchrun driven over direct ZMQ, a sampler process fed their weights",
            capabilities=frozenset({TEACHER_BACKEND}),
        ),
    ]


@hookimpl
def nexrl_transports() -> list[TransportSpec]:
    """Batches straight to FSDP workers under torchrun: JSON headers and raw tensor frames."""
    return [
        TransportSpec(
            name="direct-zmq",
            factory="nexrl_fsdp.direct_zmq.transport:DirectZmqTransport",
            config_class=DirectZmqOptions,
            description="FSDP2 workers under torchrun, driven over ZMQ (data to rank 0, execute via the workers API)",
        )
    ]


@hookimpl
def nexrl_services() -> list[ServiceSpec]:
    """The workers' control plane: groups, endpoints, heartbeats, execute."""
    return [
        ServiceSpec(
            name="workers",
            factory="nexrl_fsdp.direct_zmq.api_server:WorkersApiServer",
            config_class=ServeOptions,
            description="API server of direct-ZMQ worker groups (register, endpoints, heartbeats, execute)",
        )
    ]


@hookimpl
def nexrl_placers() -> list[PlacerSpec]:
    """Ranks on this machine, every socket on 127.0.0.1."""
    return [
        PlacerSpec(
            name=LOCAL_PLACEMENT,
            factory="nexrl_fsdp.local_placer:LocalPlacer",
            config_class=LocalPlacerOptions,
            description="worker ranks on this machine, every socket on 127.0.0.1 (the loopback launcher)",
        )
    ]


@hookimpl
def nexrl_group_engines() -> list[GroupEngineSpec]:
    """Each model of a local service with ``--workers N`` on its own group of FSDP ranks."""
    return [
        GroupEngineSpec(
            name="fsdp",
            factory="nexrl_fsdp.group_engines:FsdpGroupEngines",
            description="each training model of a local service on its own group of FSDP ranks (--workers N)",
            rank_command=RANK_COMMAND,
        )
    ]
