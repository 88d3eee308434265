"""The contract tests of every holder on a vendor SDK (`nexrl_remote_api.sdk_holder`),
defined once and run on each against NexRL's real local service.

A holder distribution's tests subclass these classes; its ``conftest.py`` gives two
fixtures: ``holder_kit`` (an `SdkHolderKit`: the holder, its config and what its paths
look like) and ``keyed_base_url`` (its local service, checking ``holder_kit.api_key``;
`nexrl_service.testing.local_service_fixtures` makes it). The checks are the core's
conformance kit (`ServiceHolderContract`, `ToolCallContract`, `LossOptionContract`) and
what every SDK holder promises besides: options its API has no field for are refused
by recipe key, LoRA targets reach the service, checkpoints round-trip, the service's
precision is checked, only the weights sampling uses are exported, and a group's
concurrent samples travel as one request with the samples each run gets alone.
Imported by tests only: it needs pytest and the SDK.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest

from nexrl_core.chat.model import SamplingOptions
from nexrl_core.config import ModelConfig
from nexrl_core.config.lora import LoraSettings
from nexrl_core.config.schema import DType
from nexrl_core.run.seeding import call_seed
from nexrl_core.testing.aggregation_cases import loss_aggregation_cases, with_entropy_bonus
from nexrl_core.testing.holder_contract import ServiceHolderContract
from nexrl_core.testing.loss_option_contract import FROZEN, LossOptionCase, LossOptionContract, gradient_norm, probe_datums
from nexrl_core.testing.toolcall_contract import ToolCallContract
from nexrl_core.training.holders import TrainStepConfig
from nexrl_core.training.model_export import ModelExportError
from nexrl_core.types import RemoteDatum, SampleResult
from nexrl_remote_api.sdk_holder import SampledSequence, SdkServiceHolder

__all__ = ["HostedSdkHolderLossOptions", "SdkHolderContract", "SdkHolderKit", "SdkHolderLossOptions", "WorkerGroupLossContract"]

TINY = ModelConfig(name="nexrl-tiny")
GROUP = 6
"""Runs of one group that sample the same prompt at once."""
AGGREGATION_CASES = loss_aggregation_cases()


@attrs.frozen(kw_only=True)
class SdkHolderKit:
    """What the shared tests need to know of one SDK's holder."""

    holder_class: type[SdkServiceHolder[Any]]
    config_class: type[Any]
    """Its `nexrl_remote_api.sdk_holder_config.SdkHolderConfig` subclass."""
    api_key: str
    """A key in the SDK's format, which the ``keyed_base_url`` service checks."""
    scheme: str
    """How the API's paths start (``tinker://``)."""
    checkpoint_segment: str
    """The path segment of a saved training state (``weights`` in ``tinker://<model>/weights/<name>``)."""
    option_cases: Sequence[LossOptionCase]
    """A loss plugin's table of option cases (``nexrl_grpo.option_cases.LOSS_OPTION_CASES``)."""

    def holder(self, base_url: str | None = None, model: ModelConfig = TINY, **options: Any) -> SdkServiceHolder[Any]:
        """A holder of ``model`` on the service at ``base_url`` with this kit's key (none
        without a URL: a holder that never connects); ``options`` are its config's own."""
        api_key = self.api_key if base_url is not None else None
        return self.holder_class(self.config_class(model=model, base_url=base_url, api_key=api_key, **options))

    @property
    def api(self) -> str:
        return self.holder_class.api


class SdkHolderContract(ServiceHolderContract, ToolCallContract):
    """The service-holder and tool-call contracts, plus what every SDK holder promises."""

    @pytest.fixture
    def holder(self, holder_kit: SdkHolderKit, keyed_base_url: str) -> Iterator[SdkServiceHolder[Any]]:
        holder = holder_kit.holder(keyed_base_url)
        try:
            yield holder
        finally:
            holder.close()

    def test_lora_alpha_is_refused_where_the_api_has_none(self, holder_kit: SdkHolderKit) -> None:
        holder = holder_kit.holder(model=ModelConfig(name="nexrl-tiny", lora=LoraSettings(rank=8, alpha=16.0)))
        assert "no LoRA alpha" in holder.refused_options(holder_kit.option_cases[0].step("token-sum"))["model.lora.alpha"]

    def test_gradient_checkpointing_is_refused_before_step_1_by_name(self, holder_kit: SdkHolderKit) -> None:
        """The API has no activation-checkpointing setting, so a recipe asking for it stops
        where the remote_api backend checks the holder, naming the key."""
        from nexrl_core.config import ConfigError, load_config
        from nexrl_core.training.holder_backend import HolderBackend

        config = load_config(None, ["model.name=nexrl-tiny", "model.gradient_checkpointing=true"])
        holder = holder_kit.holder(model=config.model)
        trainer = type("T", (), {"train_step": holder_kit.option_cases[0].step("token-sum")})()
        expected = (
            f"model.gradient_checkpointing: backend 'remote_api' cannot honour it: the {holder_kit.api} API has no activation-checkpointing"
        )
        with pytest.raises(ConfigError, match=expected):
            HolderBackend(holder, trainer, name="remote_api", work_dir=Path("unused"))

    def test_model_dtype_must_be_what_the_service_trains_in(self, holder_kit: SdkHolderKit, keyed_base_url: str) -> None:
        """The service runs in fp32 and says so; a bf16 recipe is refused with the flag that
        would start a bf16 service, and a hosted service (which says nothing) takes only the
        default."""
        holder = holder_kit.holder(keyed_base_url, ModelConfig(name="nexrl-tiny", dtype=DType.BF16))
        try:
            assert holder.run_info() == {"dtype": "float32", "device": "cpu", "max_context_length": "2048"}
            refused = holder.refused_options(TrainStepConfig())
            assert "--dtype bf16" in refused["model.dtype"] and "trains in fp32" in refused["model.dtype"]
            holder._service_capabilities, holder._probed = None, True  # hosted: no NexRL capabilities route
            assert "hosted service does not say" in holder.refused_options(TrainStepConfig())["model.dtype"]
            assert holder.run_info() == {}
        finally:
            holder.close()

    def test_the_local_service_honours_every_loss_option(self, holder: SdkServiceHolder[Any]) -> None:
        step = TrainStepConfig(loss_fn="ppo", loss_fn_config={"clip_low": 0.1, "agg_mode": "token-mean", "entropy_coeff": 0.01})
        assert holder.is_nexrl_service() and holder.refused_options(step) == {}

    def test_checkpoint_round_trip_into_the_same_and_a_new_holder(self, holder_kit: SdkHolderKit, keyed_base_url: str) -> None:
        """The holder that saved a checkpoint loads it back, and so does a new holder (a new
        session and model), as resume does."""
        first, second = holder_kit.holder(keyed_base_url), holder_kit.holder(keyed_base_url)
        try:
            path = first.save_checkpoint("contract")
            assert path.startswith(holder_kit.scheme) and path.endswith(f"/{holder_kit.checkpoint_segment}/contract")
            for holder in (first, second):
                holder.load_checkpoint(path)
                assert holder.update_sampling_weights().startswith(holder_kit.scheme)
        finally:
            first.close()
            second.close()

    @pytest.mark.parametrize(
        ("flags", "adapted", "untouched"),
        [
            ({"train_mlp": False}, {"q_proj", "o_proj", "lm_head"}, {"gate_proj", "down_proj"}),
            ({"train_attn": False, "train_unembed": False}, {"gate_proj", "down_proj"}, {"q_proj", "o_proj", "lm_head"}),
        ],
    )
    def test_lora_targets_reach_the_service(
        self, holder_kit: SdkHolderKit, keyed_base_url: str, tmp_path: Path, flags: dict[str, bool], adapted: set[str], untouched: set[str]
    ) -> None:
        """``model.lora.train_{mlp,attn,unembed}`` travel with the model's creation and decide
        which layers the service adapts (read back from the exported adapter)."""
        holder = holder_kit.holder(keyed_base_url, ModelConfig(name="nexrl-tiny", lora=LoraSettings(rank=4, **flags)))
        try:
            holder.update_sampling_weights()
            directory = holder.export_model(tmp_path / "model")
        finally:
            holder.close()
        targets = set(json.loads((directory / "adapter" / "adapter_config.json").read_text())["target_modules"])
        assert adapted <= targets and not untouched & targets, targets

    def test_export_is_refused_while_sampling_lags_the_training_weights(self, holder: SdkServiceHolder[Any], tmp_path: Path) -> None:
        """A step after the last update_sampling_weights: exporting the current weights would
        not be what sampling uses, so the holder refuses until sampling catches up."""
        holder.update_sampling_weights()
        tokens = [1, 5, 9, 14, 20]
        datum = RemoteDatum(
            input_tokens=tokens[:-1], target_tokens=tokens[1:], sampling_logprobs=[0.0] * 4, advantages=[0.0] * 4, loss_mask=[1.0] * 4
        )
        holder.train([datum], TrainStepConfig(loss_fn="cross_entropy"))
        with pytest.raises(ModelExportError, match="call update_sampling_weights"):
            holder.export_model(tmp_path / "stale")
        assert not (tmp_path / "stale").exists()
        holder.update_sampling_weights()
        assert (holder.export_model(tmp_path / "fresh") / "config.json").is_file()

    def test_a_group_is_one_request_with_the_same_samples_as_alone(self, holder_kit: SdkHolderKit, keyed_base_url: str) -> None:
        """``coalesce_window_s``: a group's concurrent requests reach the service as one
        multi-sample request, each run still gets exactly the sample it gets when sent
        alone, and a window of 0 sends each request alone."""
        messages = [{"role": "user", "content": "What is 23 + 45?"}]
        holders = [holder_kit.holder(keyed_base_url, coalesce_window_s=window_s) for window_s in (0.05, 0.0)]
        try:
            (merged, merged_sent), (alone, alone_sent) = (_sample_group(holder, messages) for holder in holders)
        finally:
            for holder in holders:
                holder.close()
        assert merged_sent == [GROUP] and alone_sent == [1] * GROUP
        for together, single in zip(merged, alone):
            assert (together.response_tokens, together.response_text, together.finish_reason) == (
                single.response_tokens, single.response_text, single.finish_reason,
            )  # fmt: skip
            assert together.response_logprobs == pytest.approx(single.response_logprobs, abs=1e-4)
        assert len({tuple(sample.response_tokens) for sample in merged}) > 1, "runs must sample differently"


def _sample_group(holder: SdkServiceHolder[Any], messages: list[dict[str, str]]) -> tuple[list[SampleResult], list[int]]:
    """The group's runs call at once, each with its own seed; returns their samples and
    the ``num_samples`` of every request the holder sent."""
    sent: list[int] = []
    send = holder._send_sample

    def counting_send(prompt: list[int], options: SamplingOptions, n: int) -> list[SampledSequence]:
        sent.append(n)
        return send(prompt, options, n)

    holder._coalescer._send = counting_send
    results: list[Any] = [None] * GROUP
    barrier = threading.Barrier(GROUP)

    def run(run_id: int) -> None:
        options = SamplingOptions(max_tokens=8, temperature=1.0, seed=call_seed(1234, 0, run_id))
        barrier.wait()
        results[run_id] = holder.sample_from_messages(messages, options)

    threads = [threading.Thread(target=run, args=(run_id,)) for run_id in range(GROUP)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return results, sent


class SdkHolderLossOptions(LossOptionContract):
    """On NexRL's service every option of every registered loss reaches the gradient."""

    @pytest.fixture
    def holder(self, holder_kit: SdkHolderKit, keyed_base_url: str) -> Iterator[SdkServiceHolder[Any]]:
        holder = holder_kit.holder(keyed_base_url)
        try:
            assert holder.is_nexrl_service()
            yield holder
        finally:
            holder.close()

    @pytest.fixture
    def option_cases(self, holder_kit: SdkHolderKit) -> Sequence[LossOptionCase]:
        return holder_kit.option_cases


class HostedSdkHolderLossOptions(SdkHolderLossOptions):
    """As against the hosted service, which has no NexRL capabilities route: what it cannot
    compute is refused before step 1 (a subclass lists it in ``refusals``), the rest still
    changes the gradient on our service, which computes it as the hosted one does."""

    @pytest.fixture
    def holder(self, holder_kit: SdkHolderKit, keyed_base_url: str) -> Iterator[SdkServiceHolder[Any]]:
        holder = holder_kit.holder(keyed_base_url)
        holder._service_capabilities, holder._probed = None, True  # what a service without NexRL's capabilities route gets
        try:
            yield holder
        finally:
            holder.close()


class WorkerGroupLossContract:
    """One step of each registered loss, in each aggregation mode, with its entropy bonus,
    on the service's in-process engine and on a worker group: the group's loss and
    gradient norm are the engine's. Needs a ``services`` fixture: ``{0: a service with
    --workers 0, N: one with --workers N}``."""

    @pytest.fixture(scope="class")
    def holders(self, services: dict[int, Any], holder_kit: SdkHolderKit) -> Iterator[dict[int, SdkServiceHolder[Any]]]:
        built = {}
        try:
            for workers, service in services.items():
                built[workers] = holder_kit.holder(service.base_url)
            yield built
        finally:
            for holder in built.values():
                holder.close()

    @pytest.mark.parametrize(
        ("loss", "options"), AGGREGATION_CASES, ids=[f"{loss}-{o.get('agg_mode', 'none')}" for loss, o in AGGREGATION_CASES]
    )
    def test_every_loss_and_aggregation_on_a_group(
        self, holders: dict[int, SdkServiceHolder[Any]], loss: str, options: dict[str, Any]
    ) -> None:
        step = TrainStepConfig(loss_fn=loss, loss_fn_config=with_entropy_bonus(loss, options), optimizer=FROZEN)
        engine_side, group_side = sorted(holders)
        datums = probe_datums(holders[engine_side])
        engine, group = (holders[workers].train(datums, step) for workers in (engine_side, group_side))
        assert gradient_norm(group) == pytest.approx(gradient_norm(engine), rel=1e-4)
        (loss_key,) = [key for key in engine if key.rpartition("/")[2].partition(":")[0] == "loss"]
        assert group[loss_key] == pytest.approx(engine[loss_key], rel=1e-4, abs=1e-6)
