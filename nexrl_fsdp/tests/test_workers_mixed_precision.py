"""``model.mixed_precision`` on the self-hosted workers: FSDP2's ``MixedPrecisionPolicy``
(bfloat16 compute, fp32 gradient reduction) over fp32 master shards, on 2 gloo ranks
under real torchrun, against the in-process engine's mixed precision.

One worker group serves the module; each test loads the model it needs (``init_model``).
The workers' step is the engine's (the same bfloat16 forward, fp32 masters and moments,
within bfloat16's rounding of the two ranks' partial gradients); the sampler process gets
the bfloat16 weights the masters round to, as bfloat16 frames; a checkpoint holds the fp32
masters and moments and resumes bit for bit; LoRA trains fp32 adapter masters on a
bfloat16 base; and the recipe key reaches the ranks through the backend's own checks.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from importlib.resources import as_file, files
from pathlib import Path

import pytest
import torch
import zmq

from nexrl_core.config import load_config
from nexrl_core.config.adamw import AdamWSettings
from nexrl_core.config.components import resolve_options
from nexrl_core.config.lora import LoraSettings
from nexrl_core.training.backend import BackendSetup
from nexrl_engine import Engine
from nexrl_engine.config import EngineConfig
from nexrl_engine.lora import merged_copy
from nexrl_fsdp.direct_zmq import wire
from nexrl_fsdp.direct_zmq.launch import WorkerGroup
from nexrl_fsdp.direct_zmq.transport import WorkerGroupError
from nexrl_fsdp.selfhosted.backend import _check, _init_workers
from nexrl_fsdp.worker.actor import HF_EXPORT_DIR
from nexrl_testing.bf16_bounds import (
    BF16_VISIBLE,
    GRAD_NORM_RELATIVE,
    LOGPROB_TOLERANCE,
    abs_advantages,
    loss_tolerance,
    max_logprob_gap,
    trained_tokens,
)

from tests.conftest import ready_sampler, training_batch, training_datums, training_runs

pytestmark = pytest.mark.slow

OPTIMIZER = AdamWSettings(learning_rate=1e-3, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.05, grad_clip_norm=0.5)
UPDATE = {"loss_fn": "importance_sampling", "optimizer": OPTIMIZER.to_json(), "micro_batch_rows": 2}


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerGroup]:
    workers = WorkerGroup(
        2, tmp_path_factory.mktemp("workers") / "workers.log", heartbeat_s=0.5, dead_after_s=5, op_timeout_s=120,
        extra_env={"NEXRL_WORKER_COLLECTIVE_TIMEOUT_S": "60"},
    )  # fmt: skip
    try:
        yield workers
    finally:
        workers.stop()


def _mixed_engine(lora: LoraSettings | None = None) -> Engine:
    return Engine(
        EngineConfig(model="nexrl-tiny", seed=0, share_prefixes=False, dtype="bf16", mixed_precision=True, lora=lora or LoraSettings())
    )


def _fp32_engine(lora: LoraSettings) -> Engine:
    return Engine(EngineConfig(model="nexrl-tiny", seed=0, share_prefixes=False, lora=lora))


def _masters_saved(group: WorkerGroup, path: Path) -> dict[str, torch.Tensor]:
    """The trained tensors of a worker checkpoint (the sharded DCP state, gathered whole)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    saved = Path(group.transport.save_checkpoint(str(path)))
    dcp_to_torch_save(str(saved), str(path.with_suffix(".pt")))
    state = torch.load(str(path.with_suffix(".pt")))
    return dict(state["model"])


def _worst(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(expected)
    return max(float((got[name].float() - expected[name].detach().float()).abs().max()) for name in expected)


def _assert_the_engines_pass(group: WorkerGroup, engine: Engine) -> float:
    """Before any step: the ranks' per-token log-probs are the mixed-precision engine's
    within bfloat16's rounding on any CPU (each side's kernels round alike only on the
    same CPU and split), and they compute in bfloat16 (some token differs from fp32's by
    more than fp32's own rounding could). Returns the largest gap, which bounds how far the two losses may differ."""
    batch, datums = training_batch(), training_datums()
    ranks = trained_tokens(group.transport.compute_log_prob(batch, micro_batch_rows=2).tolist(), batch.tensors["loss_mask"].tolist())
    masks = [datum.loss_fn_inputs["mask"] for datum in datums]
    engine_rows = trained_tokens([output.logprobs for output in engine.forward(datums, "importance_sampling").outputs], masks)
    fp32 = _fp32_engine(engine.config.lora)
    fp32_rows = trained_tokens([output.logprobs for output in fp32.forward(datums, "importance_sampling").outputs], masks)
    gap = max_logprob_gap(ranks, engine_rows)
    assert gap <= LOGPROB_TOLERANCE
    assert max_logprob_gap(ranks, fp32_rows) > BF16_VISIBLE, "the ranks compute in bfloat16"
    return gap


def _loss_tolerance(engine: Engine, gap: float) -> float:
    """How far the ranks' loss may be from the engine's when their log-probs are ``gap`` apart."""
    return loss_tolerance(engine.forward(abs_advantages(training_datums()), "importance_sampling").metrics["loss:sum"], gap)


def _relative(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> float:
    """How far one step's update on the workers is from the engine's, relative to its size."""
    moved = torch.cat([(got[name].float() - start[name].float()).flatten() for name in start])
    reference = torch.cat([(expected[name].detach().float() - start[name].float()).flatten() for name in start])
    return float((moved - reference).norm() / reference.norm())


def test_a_mixed_precision_step_on_two_ranks_is_the_engines(group: WorkerGroup, tmp_path: Path) -> None:
    """The ranks hold fp32 shards and compute in bfloat16: the loss and gradient norm are
    the engine's within bfloat16's rounding, the fp32 masters after the step are the
    engine's to within a small part of the step, and the gathered weights are the
    bfloat16 rounding of the workers' own masters, exactly."""
    info = group.transport.init_model("nexrl-tiny", dtype="bfloat16", seed=0, mixed_precision=True)
    assert (info["dtype"], info["master_dtype"]) == ("bfloat16", "float32")
    engine = _mixed_engine()
    start = {name: tensor.detach().clone() for name, tensor in engine.trained_parameters().items()}
    tolerance = _loss_tolerance(engine, _assert_the_engines_pass(group, engine))
    metrics = group.transport.update_actor(training_batch(), UPDATE)
    reference = engine.forward_backward(training_datums(), "importance_sampling")
    step = engine.optim_step(OPTIMIZER)
    assert abs(metrics["loss:sum"] - reference.metrics["loss:sum"]) <= tolerance
    assert metrics["actor/grad_norm"] == pytest.approx(step.grad_norm, rel=GRAD_NORM_RELATIVE)
    masters = _masters_saved(group, tmp_path / "checkpoint")
    assert {tensor.dtype for tensor in masters.values()} == {torch.float32}
    assert _relative(masters, engine.trained_parameters(), start) < 0.02
    gathered = group.transport.get_weights()
    assert {tensor.dtype for tensor in gathered.values()} == {torch.bfloat16}
    assert all(torch.equal(gathered[name], masters[name].to(torch.bfloat16)) for name in gathered)


def test_the_sampler_gets_the_bf16_weights_the_masters_round_to(group: WorkerGroup, tmp_path: Path) -> None:
    """``push_weights`` sends bfloat16 frames (half the bytes of the masters), and the
    sampler process, a plain bfloat16 engine, then holds exactly the gathered weights."""
    group.transport.init_model("nexrl-tiny", dtype="bfloat16", seed=0, mixed_precision=True)
    group.transport.update_actor(training_batch(), UPDATE)
    received: list[dict[str, torch.dtype]] = []
    context = zmq.Context()
    probe = context.socket(zmq.ROUTER)
    port = probe.bind_to_random_port("tcp://127.0.0.1")

    def answer_one() -> None:
        """Take one load_weights request, note its frames' dtypes and say they are loaded
        (the socket is only used on this thread, and closed when the thread is done)."""
        if probe.poll(60_000):
            (identity,), message = wire.recv(probe, key=group.key, prefix_frames=1)
            received.append({name: tensor.dtype for name, tensor in message.tensors.items()})
            wire.send(probe, {"kind": "loaded", "id": message.header["id"]}, key=group.key, prefix=[identity])

    listener = threading.Thread(target=answer_one, daemon=True)
    listener.start()
    try:
        group.transport.push_weights(f"tcp://127.0.0.1:{port}")
    finally:
        listener.join(timeout=90)
        probe.close(linger=0)
        context.term()
    (dtypes,) = received
    assert dtypes and set(dtypes.values()) == {torch.bfloat16}

    with ready_sampler(tmp_path, group.key, dtype="bf16") as (sampler, endpoint):
        gathered = group.transport.get_weights()
        assert group.transport.push_weights(endpoint) == len(gathered)
        from safetensors.torch import load_file

        exported = sampler.request({"kind": "export", "path": str(tmp_path / "hf")}).header["path"]
        loaded = load_file(str(Path(exported) / "model.safetensors"))
        assert all(torch.equal(loaded[name], gathered[name]) for name in loaded), "the sampler holds the rounded masters, exactly"


def test_a_checkpoint_holds_the_fp32_masters_and_moments_and_resumes_bit_for_bit(group: WorkerGroup, tmp_path: Path) -> None:
    """Save after one step, take a second; load the save into freshly loaded ranks and
    take the second again: the same loss and the same masters, bit for bit. The sharded
    state is fp32 (masters and AdamW moments); the checkpoint's HF export is bfloat16."""
    from torch.distributed.checkpoint import FileSystemReader

    group.transport.init_model("nexrl-tiny", dtype="bfloat16", seed=0, mixed_precision=True)
    group.transport.update_actor(training_batch(), UPDATE)
    saved = Path(group.transport.save_checkpoint(str(tmp_path / "checkpoint")))
    metadata = FileSystemReader(str(saved)).read_metadata().state_dict_metadata
    floating = {
        key: entry.properties.dtype
        for key, entry in metadata.items()
        if hasattr(entry, "properties") and entry.properties.dtype.is_floating_point
    }
    assert any(key.startswith("optimizer.state.") and "exp_avg" in key for key in floating)
    assert {dtype for key, dtype in floating.items() if not key.endswith(".step")} == {torch.float32}
    from safetensors.torch import load_file

    assert {tensor.dtype for tensor in load_file(str(saved / HF_EXPORT_DIR / "model.safetensors")).values()} == {torch.bfloat16}
    assert json.loads((saved / HF_EXPORT_DIR / "config.json").read_text())["dtype"] == "bfloat16", "the config names what was written"

    second = group.transport.update_actor(training_batch(), UPDATE)
    after_second = _masters_saved(group, tmp_path / "after_second")
    group.transport.init_model("nexrl-tiny", dtype="bfloat16", seed=0, mixed_precision=True)
    group.transport.load_checkpoint(str(saved))
    again = group.transport.update_actor(training_batch(), UPDATE)
    assert again["loss:sum"] == second["loss:sum"] and again["actor/grad_norm"] == second["actor/grad_norm"]
    assert _worst(_masters_saved(group, tmp_path / "again"), after_second) == 0.0


def test_lora_with_mixed_precision_on_two_ranks_is_the_engines(group: WorkerGroup, tmp_path: Path) -> None:
    """Only the adapters have (fp32) masters; the ranks' step moves them as the engine's
    mixed-precision LoRA step does, and the merged weights they hand out are bfloat16."""
    lora = LoraSettings(rank=4, alpha=8.0)
    group.transport.init_model("nexrl-tiny", dtype="bfloat16", seed=0, lora=lora, mixed_precision=True)
    engine = _mixed_engine(lora)
    start = {name: tensor.detach().clone() for name, tensor in engine.trained_parameters().items()}
    settings = AdamWSettings(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=1.0)
    tolerance = _loss_tolerance(engine, _assert_the_engines_pass(group, engine))
    metrics = group.transport.update_actor(training_batch(), {**UPDATE, "optimizer": settings.to_json()})
    reference = engine.forward_backward(training_datums(), "importance_sampling")
    step = engine.optim_step(settings)
    assert abs(metrics["loss:sum"] - reference.metrics["loss:sum"]) <= tolerance
    assert metrics["actor/grad_norm"] == pytest.approx(step.grad_norm, rel=GRAD_NORM_RELATIVE)
    masters = _masters_saved(group, tmp_path / "checkpoint")
    assert masters and all("lora_" in name for name in masters) and {t.dtype for t in masters.values()} == {torch.float32}
    assert _relative(masters, engine.trained_parameters(), start) < 0.05  # measured 0.005
    gathered = group.transport.get_weights()
    assert {tensor.dtype for tensor in gathered.values()} == {torch.bfloat16}
    merged = {name: p.detach() for name, p in merged_copy(engine._peft).named_parameters()}
    assert _worst(gathered, merged) < 2e-3  # measured 5e-4: one bfloat16 step where a rounding went the other way


def test_mixed_precision_with_float32_is_refused_by_the_workers(group: WorkerGroup) -> None:
    with pytest.raises(WorkerGroupError, match="mixed_precision needs dtype bfloat16"):
        group.transport.init_model("nexrl-tiny", dtype="float32", seed=0, mixed_precision=True)


def test_the_recipe_key_reaches_the_workers_through_the_backend(tmp_path: Path, group: WorkerGroup) -> None:
    """``model.mixed_precision`` in a self-hosted recipe: the backend's checks pass it,
    ``init_model`` gives the ranks fp32 masters under bfloat16 compute, and a step trains."""
    with as_file(files("nexrl_core").joinpath("recipes", "quickstart.yaml")) as path:
        config = load_config(
            path,
            [f"output.dir={tmp_path / 'run'}", "backend.name=self-hosted", "backend.options={world_size: 2}",
             "model.dtype=bf16", "model.mixed_precision=true"],
        )  # fmt: skip
    setup = BackendSetup(recipe=config, options=resolve_options("backends", config.backend, "backend"), work_dir=tmp_path / "backend")
    trainer = _check(setup, setup.options)
    try:
        info = _init_workers(setup, trainer, group.transport)  # type: ignore[arg-type]
        assert (info["dtype"], info["master_dtype"]) == ("bfloat16", "float32")
        metrics = trainer.train(training_runs(), 1)
    finally:
        trainer.close()
    assert metrics["train/actor/grad_norm"] > 0
