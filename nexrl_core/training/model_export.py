"""The trained model as an output: a plain Hugging Face directory that a run leaves behind.

``nexrl train`` ends by writing the policy that sampling used last to
``<output.dir>/final_model``; ``nexrl export`` writes the same from any checkpoint of a
run. The backend writes the files (`nexrl_core.training.backend.Backend.export_model`); this
module makes them appear under their name in one step: the backend writes into
``<target>.partial`` and the finished directory then takes the target's name, so an
error or a crash halfway never leaves half a model where a user loads one.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nexrl_core.training.backend import Backend

FINAL_MODEL_DIR = "final_model"
"""Where, in a run's output directory, the final policy goes."""
ADAPTER_DIR = "adapter"
"""Where, in an exported directory, a LoRA run's adapter goes in PEFT layout (the
weights beside it have the adapter merged in)."""
HF_CONFIG_FILE = "config.json"


class ModelExportError(RuntimeError):
    """A backend could not write the model; the message names the backend and says why."""


def export_into(backend: Backend, target: Path) -> Path:
    """Have ``backend`` write its sampling weights as an HF directory at ``target``,
    replacing what was there; returns ``target``.

    :raises ModelExportError: when the backend cannot export, or wrote no ``config.json``.
    """
    target = Path(target)
    partial = target.with_name(target.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.parent.mkdir(parents=True, exist_ok=True)
    try:
        backend.export_model(partial)
        if not (partial / HF_CONFIG_FILE).is_file():
            raise ModelExportError(f"the backend wrote no {HF_CONFIG_FILE} into {partial}, so it is not an HF model directory")
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    previous = target.with_name(target.name + ".previous")
    if previous.exists():
        shutil.rmtree(previous)
    if target.exists():
        target.rename(previous)
    partial.rename(target)
    shutil.rmtree(previous, ignore_errors=True)
    return target
