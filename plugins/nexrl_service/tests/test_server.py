"""`LocalService` with a protocol of a few lines: port 0, a busy port, clean stop."""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from echo_service import EchoService

from nexrl_core.http.serving import ServeOptions, ServiceStartError
from nexrl_engine.loading import SHIPPED_HUB_NAMES
from nexrl_service.state import ServiceState


def test_port_zero_serves_and_stop_leaves_no_threads(tmp_path: Path) -> None:
    before = {t.ident for t in threading.enumerate()}
    service = EchoService(ServeOptions(port=0, data_dir=str(tmp_path)))
    url = service.start()
    assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
    answer = httpx.get(f"{url}/api/v1/healthz").json()
    served = SHIPPED_HUB_NAMES["nexrl-tiny"].model_name  # the shipped model, by the Hub-style name it is served as
    assert answer == {"status": "ok", "model": served, "epoch": service.state.book.epoch}
    with pytest.raises(RuntimeError, match="already running"):
        service.start()
    service.stop()
    service.stop()  # idempotent
    leftovers = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert leftovers == [], leftovers
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/api/v1/healthz", timeout=2)
    assert (tmp_path / "echo.db").is_file(), "the database is named after the protocol and stays"


def test_busy_port_fails_in_start(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        service = EchoService(ServeOptions(port=port, data_dir=str(tmp_path)))
        with pytest.raises(ServiceStartError, match=f"cannot listen on 127.0.0.1:{port}"):
            service.start()
        assert service.state is None


class _RecordedEngine:
    """Stands in for `nexrl_engine.Engine`: remembers the config it was built with."""

    def __init__(self, config: Any = None, **fields: Any) -> None:
        from nexrl_engine.config import EngineConfig

        self.config = config if config is not None else EngineConfig(**fields)
        self.loaded: list[str] = []

    def load_state(self, path: str, load_optimizer: bool = True) -> None:
        self.loaded.append(path)


def test_the_device_option_reaches_every_engine_the_service_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``ServeOptions.device`` (``nexrl serve NAME --device``) is the device of the training
    engines and of every kind of sampler: the base model's, an exported model's and one
    on a saved training state. Engines are recorded, not built, so any device name works
    on a machine without it."""
    from nexrl_core.config.lora import LoraSettings
    from nexrl_engine.config import TrainingSpec
    from nexrl_service import engines as engines_module
    from nexrl_service.engines import WeightsRef
    from nexrl_service.settings import ServerSettings

    monkeypatch.setattr(engines_module, "_new_engine", _RecordedEngine)
    state = ServiceState(ServerSettings.from_options(ServeOptions(data_dir=str(tmp_path), device="cuda:1", dtype="bf16"), "echo"))
    try:
        pool = state.engines
        spec = TrainingSpec(base_model="nexrl-tiny", lora=LoraSettings(rank=4))
        built = [
            pool.new_training_engine("model-a", spec),
            pool.sampler(WeightsRef("base")),
            pool.sampler(WeightsRef("hf", directory=str(tmp_path / "exported"))),
            pool.sampler(WeightsRef("state", directory=str(tmp_path / "state"), training=spec)),
        ]
        assert [(engine.config.device, engine.config.dtype) for engine in built] == [("cuda:1", "bfloat16")] * 4
        assert built[0].config.lora.rank == 4 and built[3].loaded == [str(tmp_path / "state")]
    finally:
        state.close()


def test_a_device_this_machine_lacks_is_refused_before_anything_starts(tmp_path: Path) -> None:
    from nexrl_testing.devices import absent_device

    device = absent_device()
    for separate_process in (False, True):
        service = EchoService(ServeOptions(port=0, data_dir=str(tmp_path), device=device, separate_process=separate_process))
        with pytest.raises(ServiceStartError, match=f"^--device: '{device}' asks for ") as refused:
            service.start()
        assert (refused.value.option, refused.value.reason) == ("device", str(refused.value).removeprefix("--device: "))
        assert service.state is None and service.pid is None and service.base_url is None
