"""FSDP workers under real torchrun (2 gloo ranks), driven over direct ZMQ, against the single-process engine.

One worker group serves the whole module; tests run in file order (the update test
trains it once, later tests compare against an engine trained the same way). The LoRA
tests come last: they load LoRA models on the same group (``init_model``), whose
adapters come from the engine's own `LoraSettings` record, so on the same data the
workers reach the engine's weights, train only the adapters, resume from a sharded
checkpoint and export what `Engine.export_hf` writes (merged weights plus the adapter).
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from nexrl_core.config.adamw import AdamWSettings
from nexrl_core.config.lora import LoraSettings
from nexrl_core.testing import TransportContract
from nexrl_core.testing.aggregation_cases import loss_aggregation_cases, with_entropy_bonus
from nexrl_core.testing.hf_model import load_exported, sequence_logprobs
from nexrl_core.training.batch import Batch
from nexrl_core.training.model_export import ADAPTER_DIR
from nexrl_engine import Engine
from nexrl_engine.config import EngineConfig
from nexrl_engine.loading import load_model, resolve_model_dir
from nexrl_engine.lora import ATTN_MODULES, merged_copy
from nexrl_fsdp.direct_zmq.launch import WorkerGroup
from nexrl_fsdp.direct_zmq.transport import DirectZmqTransport, WorkerGroupError
from nexrl_fsdp.worker.actor import HF_EXPORT_DIR
from nexrl_testing.processes import process_tree, tcp_listeners

from tests.conftest import ready_sampler, training_batch, training_datums, training_runs

pytestmark = pytest.mark.slow

PACKAGES = [Path(__file__).parents[1] / "nexrl_fsdp" / name for name in ("direct_zmq", "worker", "selfhosted")]


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerGroup]:
    workers = WorkerGroup(
        2,
        tmp_path_factory.mktemp("workers") / "workers.log",
        heartbeat_s=0.5,
        dead_after_s=5,
        op_timeout_s=120,
        extra_env={"NEXRL_WORKER_COLLECTIVE_TIMEOUT_S": "60"},
    )
    try:
        workers.transport.init_model("nexrl-tiny", dtype="float32", seed=0)
        yield workers
    finally:
        workers.stop()


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(model="nexrl-tiny", seed=0, share_prefixes=False)


def _engine_log_probs(engine: Engine, batch: Batch) -> torch.Tensor:
    """The engine's teacher-forced logprobs laid out like the batch."""
    rows = engine.compute_logprobs([t.tokens for t in training_runs()])
    out = torch.zeros_like(batch.tensors["loss_mask"])
    for row, values in enumerate(rows):
        columns = torch.nonzero(batch.tensors["attention_mask"][row]).flatten()
        out[row, columns[1:]] = torch.tensor(values[1:], dtype=torch.float32)
    return out


def test_compute_log_prob_equals_the_engine(group: WorkerGroup, engine: Engine) -> None:
    batch = training_batch()
    got = group.transport.compute_log_prob(batch, micro_batch_rows=2)
    assert got.shape == batch.tensors["input_ids"].shape
    torch.testing.assert_close(got, _engine_log_probs(engine, batch), atol=1e-5, rtol=0)


def test_update_actor_gives_the_engines_loss_and_weights(group: WorkerGroup, engine: Engine) -> None:
    """Every AdamW field (none at its default) reaches the workers' optimizer: their weights
    after the step are the engine's after the same step."""
    optimizer = AdamWSettings(learning_rate=1e-3, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.05, grad_clip_norm=0.5)
    metrics = group.transport.update_actor(
        training_batch(), {"loss_fn": "importance_sampling", "optimizer": optimizer.to_json(), "micro_batch_rows": 2}
    )
    reference = engine.forward_backward(training_datums(), "importance_sampling")
    step = engine.optim_step(optimizer)
    assert metrics["loss:sum"] == pytest.approx(reference.metrics["loss:sum"], abs=1e-5)
    assert metrics["actor/grad_norm"] == pytest.approx(step.grad_norm, rel=1e-5)
    assert metrics["actor/lr"] == optimizer.learning_rate
    weights = group.transport.get_weights()
    own = dict(engine.model.named_parameters())
    assert set(weights) == set(own)
    worst = max(float((weights[name] - own[name].detach()).abs().max()) for name in own)
    assert worst < 1e-5


def test_compute_log_prob_after_a_step_still_equals_the_engine(group: WorkerGroup, engine: Engine) -> None:
    batch = training_batch()
    torch.testing.assert_close(group.transport.compute_log_prob(batch), _engine_log_probs(engine, batch), atol=1e-5, rtol=0)


def test_a_checkpoint_carries_the_policy_as_a_plain_hf_directory(group: WorkerGroup, tmp_path: Path) -> None:
    saved = Path(group.transport.save_checkpoint(str(tmp_path / "checkpoint")))
    model, tokenizer = load_exported(saved / HF_EXPORT_DIR)
    assert tokenizer.chat_template, "the export must carry the chat template"
    assert list((saved / HF_EXPORT_DIR).glob("*.safetensors"))
    gathered = group.transport.get_weights()
    exported = dict(model.named_parameters())
    assert set(exported) == set(gathered)
    assert all(torch.equal(exported[name].detach(), gathered[name]) for name in gathered), "the trained weights, exactly"
    batch = training_batch()
    workers = group.transport.compute_log_prob(batch)
    for row, trajectory in enumerate(training_runs()):
        columns = torch.nonzero(batch.tensors["attention_mask"][row]).flatten()[1:]
        expected = torch.tensor(sequence_logprobs(model, trajectory.tokens))
        torch.testing.assert_close(workers[row, columns], expected, atol=1e-5, rtol=0)


def test_reference_log_probs_are_the_base_weights(group: WorkerGroup) -> None:
    batch = training_batch()
    base = Engine(model="nexrl-tiny", seed=0, share_prefixes=False)
    torch.testing.assert_close(group.transport.compute_ref_log_prob(batch), _engine_log_probs(base, batch), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("damage", "complaint"),
    [
        (lambda b: b.tensors.__setitem__("input_ids", b.tensors["input_ids"].float()), "'input_ids' has dtype float32; it must be int64"),
        (lambda b: b.tensors.pop("advantages"), r"lacks tensors \['advantages'\]"),
        (lambda b: b.tensors.__setitem__("loss_mask", b.tensors["loss_mask"][:, :-1].contiguous()), "'loss_mask' has shape"),
    ],
)
def test_a_malformed_batch_is_refused_and_the_workers_stay_usable(group: WorkerGroup, damage, complaint: str) -> None:
    batch = training_batch()
    damage(batch)
    with pytest.raises(WorkerGroupError, match=complaint):
        group.transport.update_actor(batch, {"loss_fn": "importance_sampling"})
    group.transport.barrier()
    assert group.transport.compute_log_prob(training_batch()).shape == training_batch().tensors["input_ids"].shape


def test_bad_update_options_are_refused_by_name(group: WorkerGroup) -> None:
    with pytest.raises(WorkerGroupError, match="'seq-mean-token-avg' is not a valid AggMode"):
        group.transport.update_actor(
            training_batch(), {"loss_fn": "importance_sampling", "loss_fn_config": {"agg_mode": "seq-mean-token-avg"}}
        )
    with pytest.raises(WorkerGroupError, match="unknown update_actor options"):
        group.transport.update_actor(training_batch(), {"loss_fn": "importance_sampling", "epochs": 2})


def test_push_weights_sends_the_policy_from_rank_0_to_a_sampler_process(group: WorkerGroup, tmp_path: Path) -> None:
    with ready_sampler(tmp_path, group.key) as (sampler, endpoint):
        with pytest.raises(WorkerGroupError, match="push_weights refused: push_weights needs options.endpoint"):
            group.transport.push_weights("http://127.0.0.1:1")
        gathered = group.transport.get_weights()
        sampler.request({"kind": "load_weights"}, {name: tensor * 0.5 for name, tensor in gathered.items()})
        assert group.transport.push_weights(endpoint) == len(gathered)
        exported, _ = load_exported(Path(sampler.request({"kind": "export", "path": str(tmp_path / "hf")}).header["path"]))
        loaded = dict(exported.named_parameters())
        assert all(torch.equal(loaded[name].detach(), gathered[name]) for name in gathered), (
            "the sampler holds the trained weights, exactly"
        )


def test_no_pickle_on_the_driver_side(group: WorkerGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("pickle was used")

    for name in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    for name in ("send_pyobj", "recv_pyobj"):
        monkeypatch.setattr(zmq.Socket, name, refuse)
    assert group.transport.compute_log_prob(training_batch()).shape[0] == 5


def test_no_module_of_the_transport_or_the_workers_can_pickle() -> None:
    for package in PACKAGES:
        for path in package.glob("*.py"):
            tree = ast.parse(path.read_text())
            imported = {alias.name for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
            imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
            assert not imported & {"pickle", "cloudpickle", "dill"}, path
            calls = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
            assert not calls & {
                "send_pyobj",
                "recv_pyobj",
                "all_gather_object",
                "broadcast_object_list",
                "gather_object",
                "scatter_object_list",
            }, path


def test_a_local_group_listens_on_the_loopback_only(group: WorkerGroup) -> None:
    """Every socket the group listens on (the process group's store, gloo's sockets, the
    ranks' data sockets, this process's API server and command socket) is on 127.0.0.1
    or ::1: nothing of a local run is reachable from another machine."""

    pids = process_tree(group.placed.process.pid) + [os.getpid()]
    listeners = tcp_listeners(pids)
    ranks = set(group.rank_pids().values())
    beyond = [(pid, address, port) for pid, address, port in listeners if address not in ("127.0.0.1", "::1")]
    assert beyond == [], f"listening beyond the loopback: {beyond}"
    assert {pid for pid, _, _ in listeners} >= ranks | {os.getpid()}, listeners
    assert len([pid for pid, _, _ in listeners if pid == group.rank_pids()[0]]) >= 3, "rank 0: the store, gloo and its data socket"


class TestDirectZmqTransport(TransportContract):
    """The conformance kit's transport contract against the module's worker group."""

    @pytest.fixture
    def transport(self, group: WorkerGroup) -> DirectZmqTransport:
        return group.transport


@pytest.mark.parametrize(
    "flag",
    ["--db=sqlite://", "--model=/some/model", "--dtype=bf16", "--device=cuda", "--data-dir=/tmp/x", "--max-tokens-per-microbatch=24"],
)
def test_serve_workers_refuses_flags_it_has_no_use_for(flag: str) -> None:
    nexrl = str(Path(sys.executable).with_name("nexrl"))
    done = subprocess.run([nexrl, "serve", "workers", "--port", "0", flag], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and flag.split("=")[0] in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_the_transport_and_the_api_server_are_registered() -> None:
    from nexrl_core.plugins.registry import find_spec

    assert find_spec("transports", "direct-zmq").resolve_factory() is DirectZmqTransport
    assert find_spec("services", "workers").resolve_factory().__name__ == "WorkersApiServer"


RATIO_SHIFTS = torch.tensor([0.5, -0.5, 2.0, -0.1, 0.3, -2.0, 0.05, 1.0, -1.0])
"""Log importance ratios laid over the response tokens: inside and outside every clip
range, huge ones on the rows with negative advantages (dual clip)."""


def _probe_batch(group: WorkerGroup) -> Batch:
    """The module's batch with old logprobs set so the importance ratios are `RATIO_SHIFTS`."""
    batch = training_batch()
    current = group.transport.compute_log_prob(batch)
    mask = batch.tensors["loss_mask"]
    shifts = RATIO_SHIFTS.repeat(mask.numel() // len(RATIO_SHIFTS) + 1)[: mask.numel()].reshape(mask.shape)
    batch.tensors["old_logprobs"] = (current - shifts) * mask
    return batch


def test_every_loss_option_reaches_the_workers_gradient(group: WorkerGroup) -> None:
    """Each option of each registered loss (`LOSS_OPTION_CASES`) changes the gradient the
    workers compute, with an optimizer that cannot move the weights."""
    from nexrl_grpo.option_cases import LOSS_OPTION_CASES

    frozen = AdamWSettings(learning_rate=0.0, weight_decay=0.0, grad_clip_norm=0.0).to_json()
    batch = _probe_batch(group)
    checked = []
    for case in LOSS_OPTION_CASES:
        norms = [
            group.transport.update_actor(
                batch,
                {"loss_fn": case.loss, "loss_fn_config": {**case.fixed, case.option: value}, "optimizer": frozen, "micro_batch_rows": 2},
            )["actor/grad_norm"]
            for value in (case.value, case.other)
        ]
        assert norms[0] != pytest.approx(norms[1], rel=1e-6), f"{case.loss}.{case.option} left the workers' gradient unchanged: {norms}"
        checked.append(f"{case.loss}.{case.option}")
    assert len(checked) == len(LOSS_OPTION_CASES), checked


AGGREGATION_CASES = loss_aggregation_cases()


@pytest.mark.parametrize(
    ("loss", "options"), AGGREGATION_CASES, ids=[f"{loss}-{o.get('agg_mode', 'none')}" for loss, o in AGGREGATION_CASES]
)
def test_the_workers_step_does_not_depend_on_ranks_or_micro_batches(group: WorkerGroup, loss: str, options: dict[str, Any]) -> None:
    """Every registered loss under every aggregation: the 2-rank group's gradient norm and
    loss are the same with one row, every row, or a 20-token budget per pass, and equal to one process's
    (the engine's) on the whole batch; an optimizer with learning rate 0 keeps the weights."""
    options = with_entropy_bonus(loss, options)
    frozen = AdamWSettings(learning_rate=0.0, weight_decay=0.0, grad_clip_norm=0.0)
    engine = Engine(model="nexrl-tiny", seed=0, share_prefixes=False)
    weights = group.transport.get_weights()
    with torch.no_grad():
        for name, parameter in engine.model.named_parameters():
            parameter.copy_(weights[name])
    reference = engine.forward_backward(training_datums(), loss, options)
    reference_norm = engine.optim_step(frozen).grad_norm
    key = "loss:sum" if options.get("agg_mode", "token-sum") == "token-sum" else "loss:mean"
    for limits in ({"micro_batch_rows": 1}, {"micro_batch_rows": 8}, {"micro_batch_rows": 8, "max_tokens_per_microbatch": 20}):
        metrics = group.transport.update_actor(
            training_batch(), {"loss_fn": loss, "loss_fn_config": options, "optimizer": frozen.to_json(), **limits}
        )
        assert metrics["actor/grad_norm"] == pytest.approx(reference_norm, rel=1e-4), f"passes of {limits}"
        assert metrics[key] == pytest.approx(reference.metrics[key], rel=1e-4, abs=1e-6), f"passes of {limits}"


def test_runs_sharing_a_prompt_give_the_engines_logprobs_and_gradient(group: WorkerGroup) -> None:
    """Rows of one group run their shared prompt once on each rank (`chunk_logprobs`, the
    engine's prefix sharing, inside FSDP): logprobs, loss and gradient norm equal a
    plain pass of the engine (which shares nothing) on the same weights."""
    from nexrl_engine.shared_prefix import plan_prefix_sharing

    group_size = 3
    tokens = [run.tokens for run in training_runs(group_size)]
    assert plan_prefix_sharing(tokens[:3]) is not None, "rank 0's rows must be worth sharing, or this checks nothing"
    engine = Engine(model="nexrl-tiny", seed=0, share_prefixes=False)
    weights = group.transport.get_weights()
    with torch.no_grad():
        for name, parameter in engine.model.named_parameters():
            parameter.copy_(weights[name])
    batch = training_batch(group_size)
    expected = torch.zeros_like(batch.tensors["loss_mask"])
    for row, values in enumerate(engine.compute_logprobs(tokens)):
        columns = torch.nonzero(batch.tensors["attention_mask"][row]).flatten()
        expected[row, columns[1:]] = torch.tensor(values[1:], dtype=torch.float32)
    torch.testing.assert_close(group.transport.compute_log_prob(batch, micro_batch_rows=8), expected, atol=1e-5, rtol=0)
    frozen = AdamWSettings(learning_rate=0.0, weight_decay=0.0, grad_clip_norm=0.0)
    reference = engine.forward_backward(training_datums(group_size), "importance_sampling", {"agg_mode": "token-mean"})
    reference_norm = engine.optim_step(frozen).grad_norm
    metrics = group.transport.update_actor(
        batch,
        {
            "loss_fn": "importance_sampling",
            "loss_fn_config": {"agg_mode": "token-mean"},
            "optimizer": frozen.to_json(),
            "micro_batch_rows": 8,
        },
    )
    assert metrics["actor/grad_norm"] == pytest.approx(reference_norm, rel=1e-4)
    assert metrics["loss:mean"] == pytest.approx(reference.metrics["loss:mean"], rel=1e-4)


# --- LoRA: the engine's `LoraSettings` on the same group (init_model loads a fresh model) ---

LORA = LoraSettings(rank=4, alpha=8.0)
"""Every target (the tied ``lm_head`` too) and an alpha other than the default."""


def attention_only() -> LoraSettings:
    """q/k/v/o adapters alone, built inside the test that uses them (so the recipe-key
    records see ``train_mlp`` and ``train_unembed`` set off)."""
    return LoraSettings(rank=2, alpha=4.0, train_mlp=False, train_unembed=False)


LORA_OPTIMIZER = AdamWSettings(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=1.0)
"""A rate large enough that one step moves every adapter (B starts at zero)."""
LORA_UPDATE = {"loss_fn": "importance_sampling", "optimizer": LORA_OPTIMIZER.to_json(), "micro_batch_rows": 2}


@pytest.fixture(scope="module")
def base_engine() -> Engine:
    """The untrained base model (full fine-tuning engine, never trained)."""
    return Engine(model="nexrl-tiny", seed=0, share_prefixes=False)


def _lora_engine(lora: LoraSettings) -> Engine:
    return Engine(EngineConfig(model="nexrl-tiny", seed=0, share_prefixes=False, lora=lora))


def _lora_engine_step(engine: Engine) -> None:
    engine.forward_backward(training_datums(), "importance_sampling")
    engine.optim_step(LORA_OPTIMIZER)


def _merged(engine: Engine) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in merged_copy(engine._peft).named_parameters()}


def _worst(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(expected)
    return max(float((got[name] - expected[name]).abs().max()) for name in expected)


def test_a_lora_update_on_two_ranks_equals_the_engines(group: WorkerGroup) -> None:
    info = group.transport.init_model("nexrl-tiny", dtype="float32", seed=0, lora=LORA)
    assert info["world_size"] == 2
    engine = _lora_engine(LORA)
    metrics = group.transport.update_actor(training_batch(), LORA_UPDATE)
    reference = engine.forward_backward(training_datums(), "importance_sampling")
    step = engine.optim_step(LORA_OPTIMIZER)
    assert metrics["loss:sum"] == pytest.approx(reference.metrics["loss:sum"], rel=1e-5)
    assert metrics["actor/grad_norm"] == pytest.approx(step.grad_norm, rel=1e-5)
    weights = group.transport.get_weights()
    assert "lm_head.weight" in weights, "the merged lm_head adapter gives the head a weight of its own"
    assert _worst(weights, _merged(engine)) < 1e-5
    batch = training_batch()
    torch.testing.assert_close(group.transport.compute_log_prob(batch), _engine_log_probs(engine, batch), atol=1e-5, rtol=0)


def test_the_reference_of_a_lora_policy_is_its_base(group: WorkerGroup, base_engine: Engine) -> None:
    batch = training_batch()
    reference = group.transport.compute_ref_log_prob(batch)
    torch.testing.assert_close(reference, _engine_log_probs(base_engine, batch), atol=1e-5, rtol=0)
    assert not torch.allclose(group.transport.compute_log_prob(batch), reference, atol=1e-4), "the policy has moved"


def test_pushed_lora_weights_are_the_merged_policy(group: WorkerGroup, tmp_path: Path) -> None:
    """The sampler (a plain model with tied embeddings) takes the merged weights, its
    head untied, and scores as the workers' policy does."""
    with ready_sampler(tmp_path, group.key) as (sampler, endpoint):
        gathered = group.transport.get_weights()
        assert group.transport.push_weights(endpoint) == len(gathered)
        exported, _ = load_exported(Path(sampler.request({"kind": "export", "path": str(tmp_path / "hf")}).header["path"]))
        loaded = dict(exported.named_parameters())
        assert all(torch.equal(loaded[name].detach(), gathered[name]) for name in gathered), "the sampler holds the merged weights, exactly"
        assert not torch.equal(loaded["lm_head.weight"], loaded["model.embed_tokens.weight"]), "the input embeddings kept their own"


def _adapter_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "adapter_model.safetensors"))


def test_a_lora_checkpoint_resumes_and_exports_like_the_engine(group: WorkerGroup, tmp_path: Path) -> None:
    """Save after one step, take a second; load the save into a freshly loaded model and
    take the second again: the same loss and weights. The checkpoint holds the adapters
    and their optimizer state, and its ``hf`` export is `Engine.export_hf`'s."""
    engine = _lora_engine(LORA)
    _lora_engine_step(engine)
    saved = Path(group.transport.save_checkpoint(str(tmp_path / "checkpoint")))
    engine.export_hf(tmp_path / "engine")
    export = saved / HF_EXPORT_DIR
    assert _adapter_tensors(export / ADAPTER_DIR).keys() == _adapter_tensors(tmp_path / "engine" / ADAPTER_DIR).keys()
    worst = max(
        float((_adapter_tensors(export / ADAPTER_DIR)[name] - tensor).abs().max())
        for name, tensor in _adapter_tensors(tmp_path / "engine" / ADAPTER_DIR).items()
    )
    assert worst < 1e-5
    assert json.loads((export / ADAPTER_DIR / "adapter_config.json").read_text()) == json.loads(
        (tmp_path / "engine" / ADAPTER_DIR / "adapter_config.json").read_text()
    )
    saved_tensors = _checkpoint_tensors(saved)
    assert saved_tensors and all("lora_" in name for name in saved_tensors), "only what trains is in the sharded checkpoint"

    second = group.transport.update_actor(training_batch(), LORA_UPDATE)
    after_second = group.transport.get_weights()
    group.transport.init_model("nexrl-tiny", dtype="float32", seed=0, lora=LORA)
    group.transport.load_checkpoint(str(saved))
    again = group.transport.update_actor(training_batch(), LORA_UPDATE)
    assert again["loss:sum"] == pytest.approx(second["loss:sum"], rel=1e-6)
    assert again["actor/grad_norm"] == pytest.approx(second["actor/grad_norm"], rel=1e-6)
    assert _worst(group.transport.get_weights(), after_second) < 1e-6


def _checkpoint_tensors(path: Path) -> list[str]:
    """Names of the model tensors a DCP checkpoint holds."""
    from torch.distributed.checkpoint import FileSystemReader

    return [
        key.removeprefix("model.") for key in FileSystemReader(str(path)).read_metadata().state_dict_metadata if key.startswith("model.")
    ]


def test_the_exported_lora_policy_loads_with_transformers_and_peft(group: WorkerGroup, tmp_path: Path) -> None:
    """Plain transformers loads the merged weights, peft the adapter onto the base model,
    and both score as the workers' policy does."""
    from peft import PeftModel

    export = Path(group.transport.save_checkpoint(str(tmp_path / "checkpoint"))) / HF_EXPORT_DIR
    merged, tokenizer = load_exported(export)
    assert tokenizer.chat_template, "the export must carry the chat template"
    assert not any("lora" in name for name, _ in merged.named_parameters()), "the weights must be merged"
    gathered = group.transport.get_weights()
    assert all(torch.equal(p.detach(), gathered[name]) for name, p in merged.named_parameters())
    adapted = PeftModel.from_pretrained(load_model(resolve_model_dir("nexrl-tiny"), torch.float32), str(export / ADAPTER_DIR))
    batch = training_batch()
    workers = group.transport.compute_log_prob(batch)
    for row, trajectory in enumerate(training_runs()):
        columns = torch.nonzero(batch.tensors["attention_mask"][row]).flatten()[1:]
        for model in (merged, adapted):
            expected = torch.tensor(sequence_logprobs(model, trajectory.tokens))
            torch.testing.assert_close(workers[row, columns], expected, atol=1e-5, rtol=0)


def test_a_checkpoint_with_other_lora_settings_is_refused(group: WorkerGroup, tmp_path: Path) -> None:
    saved = group.transport.save_checkpoint(str(tmp_path / "checkpoint"))
    group.transport.init_model("nexrl-tiny", dtype="float32", seed=0, lora=attention_only())
    with pytest.raises(WorkerGroupError, match="was saved with LoRA settings"):
        group.transport.load_checkpoint(saved)


def test_only_the_attention_adapters_train(group: WorkerGroup, base_engine: Engine, tmp_path: Path) -> None:
    """LoRA on q/k/v/o alone: after a step the merged policy differs from the base in the
    attention projections only, and the adapter names exactly those."""
    group.transport.init_model("nexrl-tiny", dtype="float32", seed=0, lora=attention_only())
    group.transport.update_actor(training_batch(), LORA_UPDATE)
    weights = group.transport.get_weights()
    own = {name: p.detach() for name, p in base_engine.model.named_parameters()}
    assert set(weights) == set(own), "no head of its own: lm_head was not adapted"
    changed = {name for name in own if not torch.equal(weights[name], own[name])}
    attention = {name for name in own if name.rsplit(".", 2)[-2] in ATTN_MODULES and name.endswith(".weight")}
    assert changed == attention
    export = Path(group.transport.save_checkpoint(str(tmp_path / "checkpoint"))) / HF_EXPORT_DIR
    config = json.loads((export / ADAPTER_DIR / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (2, 4.0, ["k_proj", "o_proj", "q_proj", "v_proj"])


def test_bad_lora_settings_are_refused_by_name(group: WorkerGroup) -> None:
    with pytest.raises(WorkerGroupError, match=r"unknown init_model lora fields \['dropout'\]"):
        group.transport._call("init_model", {"model": "nexrl-tiny", "lora": {"rank": 4, "dropout": 0.1}})
    with pytest.raises(WorkerGroupError, match="needs at least one of train_mlp, train_attn, train_unembed"):
        group.transport._call(
            "init_model", {"model": "nexrl-tiny", "lora": {"rank": 4, "train_mlp": False, "train_attn": False, "train_unembed": False}}
        )
