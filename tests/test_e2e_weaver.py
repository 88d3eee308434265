"""`nexrl train recipes/quickstart_weaver.yaml` end to end: the embedded local Weaver
service, the shipped tiny model, the real nex-weaver SDK.

A shortened run must raise held-out reward and resume from its checkpoint (a new
service process on the same data, which must still own the run's checkpoints).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

NEXRL = str(Path(sys.executable).with_name("nexrl"))  # the nexrl under test, not whichever is first on PATH
RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "quickstart_weaver.yaml"

pytest.importorskip("nexrl_weaver")


def _train(out: Path, cwd: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("WEAVER_")}
    command = [
        NEXRL,
        "train",
        str(RECIPE),
        "schedule.steps=6",
        "schedule.validate_every=6",
        "schedule.checkpoint_every=3",
        "task.val_size=64",
        f"output.dir={out}",
        "--no-progress",
        *extra,
    ]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, cwd=cwd)


@pytest.mark.slow
def test_shortened_weaver_quickstart_raises_validation_reward_leaves_the_final_model_and_resumes(tmp_path: Path) -> None:
    """The run ends by exporting through the Weaver API (``export_weights`` +
    ``download_weights``): a trained model plain transformers loads, and ``nexrl export``
    of the last checkpoint writes the same files. Then it resumes for one more step."""
    from nexrl_core.testing.hf_model import load_exported, sequence_logprobs
    from nexrl_engine.loading import resolve_model_dir

    out = tmp_path / "run"
    completed = _train(out, tmp_path)
    assert completed.returncode == 0, completed.stdout + completed.stderr

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    validated = {row["step"]: row["val/reward/mean"] for row in rows if "val/reward/mean" in row}
    assert set(validated) == {0, 6}
    assert validated[6] >= validated[0] + 0.15, f"validation reward did not rise: {validated}"
    assert (out / "reward_curve.png").stat().st_size > 0
    assert (out / "backend" / "service" / "weaver.db").exists()

    final = out / "final_model"
    model, tokenizer = load_exported(final)
    assert tokenizer.chat_template
    tokens = tokenizer.apply_chat_template(
        [{"role": "user", "content": "12+7="}, {"role": "assistant", "content": "19"}], tokenize=True, return_dict=False
    )
    base, _ = load_exported(resolve_model_dir("nexrl-tiny"))
    assert sequence_logprobs(model, tokens) != pytest.approx(sequence_logprobs(base, tokens), abs=1e-5), "the export must be trained"

    env = {key: value for key, value in os.environ.items() if not key.startswith("WEAVER_")}
    exported = subprocess.run([NEXRL, "export", str(out)], capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert exported.returncode == 0, exported.stdout + exported.stderr
    again = Path(exported.stdout.strip().splitlines()[-1])
    names = sorted(str(path.relative_to(final)) for path in final.rglob("*") if path.is_file())
    assert names == sorted(str(path.relative_to(again)) for path in again.rglob("*") if path.is_file())
    assert (final / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()

    resumed = _train(out, tmp_path, "schedule.steps=7", "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert 7 in steps
