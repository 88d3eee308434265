"""The ``remote_api`` backend: a registered service holder against a URL, or against a
local service started for the run.

With ``base_url`` null the backend starts the registered service named like the
holder (or ``service``) on a free loopback port, from a child process, with its data
in ``<output.dir>/backend/service`` and a per-run API key kept there too, so a resumed
run (a new service process on the same data) still owns the checkpoints it saved. The
service stops when the backend closes, also after an error or Ctrl-C.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from nexrl_core.config.checks import non_empty, optional_http_url, optional_non_empty, optional_positive_int, service_device
from nexrl_core.config.converter import structure_config
from nexrl_core.config.errors import ConfigError
from nexrl_core.http.serving import DEFAULT_MAX_TOKENS_PER_MICROBATCH, ServeOptions, ServiceStartError
from nexrl_core.training.backend import BackendSetup
from nexrl_core.training.holder_backend import HolderBackend
from nexrl_core.training.holders import HolderTarget
from nexrl_core.training.trainer import build_trainer

logger = logging.getLogger(__name__)

SERVICE_DIR = "service"
DEFAULT_DEVICE = "cpu"
API_KEY_FILE = "api_key"


@attrs.frozen(kw_only=True)
class RemoteApiBackendConfig:
    """``backend.options`` of the ``remote_api`` backend."""

    service_holder: str | None = attrs.field(default=None, validator=optional_non_empty)
    """Registered service holder that talks to the service (``nexrl plugins`` lists them)."""
    base_url: str | None = attrs.field(default=None, validator=optional_http_url)
    """URL of a running service; null starts NexRL's own service on 127.0.0.1 for the run."""
    api_key_env: str | None = attrs.field(default=None, validator=optional_non_empty)
    """Environment variable holding the API key, so the key never sits in a recipe; null
    lets the holder's SDK read its own variable. Unused with an embedded service, which
    gets a fresh key per run."""
    service: str | None = attrs.field(default=None, validator=optional_non_empty)
    """Registered service started when ``base_url`` is null; null means the service named
    like ``service_holder`` (``nexrl serve NAME`` runs the same one)."""
    workers: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    """For the embedded service (``base_url`` null): ranks of the worker group the run's
    model trains on (``nexrl serve NAME --workers N``); 0 trains it in the service's own
    process. A service at ``base_url`` is configured where it runs."""
    placement: str | None = attrs.field(default=None, validator=optional_non_empty)
    """For the embedded service with ``workers``: the registered placer of the group's
    ranks (``nexrl serve NAME --placement``); null: this machine."""
    placement_options: dict[str, Any] = attrs.field(factory=dict)
    """The placer's own options (``nexrl serve NAME --placement-option KEY=VALUE``)."""
    device: str = attrs.field(default=DEFAULT_DEVICE, validator=service_device)
    """For the embedded service: where its engines live (``nexrl serve NAME --device``):
    ``cpu``, ``cuda`` or ``cuda:N``. A service at ``base_url`` is configured where it runs."""
    max_tokens_per_microbatch: int | None = attrs.field(default=None, validator=optional_positive_int)
    """For the embedded service: most padded tokens (rows x longest row) per forward or
    forward/backward pass of its engines (``nexrl serve NAME --max-tokens-per-microbatch``);
    null leaves the service's default. It bounds memory and changes nothing else. A service
    at ``base_url`` is configured where it runs."""
    trainer: str = attrs.field(default="remote_api_grpo", validator=non_empty)
    """Registered trainer that turns trajectories into the holder's training calls."""
    holder: dict[str, Any] = attrs.field(factory=dict)
    """Options of the service holder's own config class (the model, seed, URL and key
    come from the recipe and from this backend, not from here)."""


RECIPE_KEYS_OF_SERVICE_OPTIONS = {"device": "backend.options.device", "sampling_models": "teacher.model"}
"""The recipe key that set each `ServeOptions` field a refusal of the embedded service names."""


def _recipe_error(error: ServiceStartError) -> ConfigError | None:
    """The embedded service's refusal of an option the recipe set, naming the recipe's key."""
    key = RECIPE_KEYS_OF_SERVICE_OPTIONS.get(error.option or "")
    return None if key is None else ConfigError([f"{key}: {error.reason}"])


def _registered(kind: str, name: str | None, key: str) -> Any:
    from nexrl_core.plugins.registry import UnknownComponentError, find_spec, get_registry

    if name is None:
        known = ", ".join(get_registry().names(kind)) or "none installed"
        raise ConfigError([f"{key}: not set; choose one of: {known}"])
    try:
        return find_spec(kind, name)
    except UnknownComponentError as error:
        raise ConfigError([f"{key}: {error}"]) from None


def _embedded_api_key(data_dir: Path, config_class: type) -> str:
    """The run's API key, in the holder's own format (``config_class.new_api_key()``
    where it has one), made on the first run and kept in the service's data directory."""
    key_file = data_dir / API_KEY_FILE
    if not key_file.exists():
        data_dir.mkdir(parents=True, exist_ok=True)
        new_key = getattr(config_class, "new_api_key", None)
        key_file.write_text(new_key() if callable(new_key) else secrets.token_hex(16))
        key_file.chmod(0o600)
    return key_file.read_text().strip()


def holder_config(config_class: type, setup: BackendSetup, base_url: str | None, api_key: str | None) -> Any:
    """The holder's config: `HolderTarget`'s fields from the recipe and the connection,
    ``backend.options.holder`` for the holder's own options.

    :raises ConfigError: for a holder whose config is not a `HolderTarget`, or bad options.
    """
    if not (isinstance(config_class, type) and issubclass(config_class, HolderTarget)):
        raise ConfigError([f"backend.options.service_holder: its config class {config_class.__name__} must subclass HolderTarget"])
    taken = sorted(set(setup.options.holder) & {field.name for field in attrs.fields(HolderTarget)})
    if taken:
        raise ConfigError([f"backend.options.holder.{key}: set by the recipe (model.*, seed) and this backend, not here" for key in taken])
    target = {
        "model": attrs.asdict(setup.recipe.model), "seed": setup.recipe.seed, "teacher": setup.recipe.teacher.model,
        "base_url": base_url, "api_key": api_key,
    }  # fmt: skip
    return structure_config({**setup.options.holder, **target}, config_class, path="backend.options.holder")


def open_remote_api(setup: BackendSetup) -> HolderBackend:
    """Open the ``remote_api`` backend for one run.

    :raises ConfigError: for an unknown holder, service or trainer, bad holder options, or
        a setting the holder cannot honour; anything started so far is stopped first.
    """
    options: RemoteApiBackendConfig = setup.options
    if setup.recipe.model.name is None:
        raise ConfigError(["model.name: not set; name the model to train (e.g. nexrl-tiny)"])
    holder_spec = _registered("service_holders", options.service_holder, "backend.options.service_holder")
    trainer = build_trainer(setup.recipe, options.trainer, "backend.options.trainer")
    service = None
    holder = None
    try:
        base_url = options.base_url
        api_key = os.environ.get(options.api_key_env) if options.api_key_env else None
        if options.api_key_env and not api_key:
            raise ConfigError([f"backend.options.api_key_env: the environment variable {options.api_key_env} is not set"])
        _refuse_what_the_service_decides(options, base_url)
        if base_url is None:
            service, api_key = _build_embedded_service(setup, holder_spec.config_class)
            base_url = _start_embedded_service(service)
        holder = holder_spec.build(holder_config(holder_spec.config_class, setup, base_url, api_key))
        return HolderBackend(
            holder,
            trainer,
            name="remote_api",
            work_dir=setup.work_dir,
            on_close=[service.stop] if service is not None else [],
            watch=service.failure if service is not None else lambda: None,
        )
    except BaseException:
        if holder is not None:
            holder.close()
        if service is not None:
            service.stop()
        raise


def _refuse_what_the_service_decides(options: RemoteApiBackendConfig, base_url: str | None) -> None:
    """The settings only an embedded service takes, refused by key for a service at
    ``base_url`` (it decides them itself), and a placement without embedded workers."""
    if base_url is not None and options.workers:
        raise ConfigError(
            [
                f"backend.options.workers: {options.workers} applies to the embedded service only; the service at "
                f"{base_url} decides its own workers (nexrl serve NAME --workers N), so leave it out or set base_url: null"
            ]
        )
    if (options.placement is not None or options.placement_options) and (base_url is not None or not options.workers):
        raise ConfigError(
            [
                "backend.options.placement: a placer starts the ranks of the embedded service's worker groups, so it "
                "needs base_url: null and workers: N (a service at base_url decides its own placement: nexrl serve NAME "
                "--workers N --placement NAME)"
            ]
        )
    if base_url is not None and options.device != DEFAULT_DEVICE:
        raise ConfigError(
            [
                f"backend.options.device: {options.device} applies to the embedded service only; the service at "
                f"{base_url} decides its own device (nexrl serve NAME --device {options.device}), so leave it out or "
                "set base_url: null"
            ]
        )
    if base_url is not None and options.max_tokens_per_microbatch is not None:
        budget = options.max_tokens_per_microbatch
        raise ConfigError(
            [
                f"backend.options.max_tokens_per_microbatch: {budget} applies to the embedded service only; the service at "
                f"{base_url} decides its own (nexrl serve NAME --max-tokens-per-microbatch {budget}), so leave it out or "
                "set base_url: null"
            ]
        )


def _build_embedded_service(setup: BackendSetup, holder_config_class: type) -> tuple[Any, str]:
    """The registered service for the run's model (and its teacher's, to sample from),
    with the backend's options, in a child process, not started; and its API key."""
    options: RemoteApiBackendConfig = setup.options
    service_key = "backend.options.service" if options.service else "backend.options.service_holder"
    service_spec = _registered("services", options.service or options.service_holder, service_key)
    api_key = _embedded_api_key(setup.work_dir / SERVICE_DIR, holder_config_class)
    # Null: the default of every service's options (`ServeOptions`), as when the option is left out.
    budget = DEFAULT_MAX_TOKENS_PER_MICROBATCH if options.max_tokens_per_microbatch is None else options.max_tokens_per_microbatch
    model = setup.recipe.model.name
    assert model is not None, "open_remote_api refused a recipe without model.name"
    teacher = setup.recipe.teacher.model
    served = ServeOptions(
        port=0,
        model=model,
        sampling_models=() if teacher is None else (teacher,),
        dtype=setup.recipe.model.dtype.value,
        data_dir=str(setup.work_dir / SERVICE_DIR),
        api_key=api_key,
        workers=options.workers,
        placement=options.placement,
        placement_options=dict(options.placement_options),
        device=options.device,
        max_tokens_per_microbatch=budget,
        separate_process=True,
    )
    logger.info("starting the embedded service on %s (data in %s)", options.device, served.data_dir)
    return _refusing_by_recipe_key(lambda: service_spec.build(served)), api_key


def _start_embedded_service(service: Any) -> str:
    base_url = _refusing_by_recipe_key(service.start)
    logger.info("the embedded service is up at %s", base_url)
    return base_url


def _refusing_by_recipe_key(step: Callable[[], Any]) -> Any:
    """``step`` (building or starting the service), its refusal of what the recipe set
    raised as the recipe's key (`_recipe_error`)."""
    try:
        return step()
    except ServiceStartError as error:
        refused = _recipe_error(error)
        if refused is None:
            raise
        raise refused from None
