"""v1's on-policy distillation as NexRL's teacher and estimator.

v1 distilled with its ``remote_api_opd`` and ``self_hosted_opd`` trainers: a teacher
(``trainer.teachers``, or v1.4's train service of ``role: teacher``) scored the student's
sampled tokens, and each token's advantage was ``-coef x (log p_student - log p_teacher)``,
optionally plus the discounted KL of the tokens after it. NexRL's counterpart is the
recipe's ``teacher.model`` with the ``on_policy_distillation`` estimator and
``task_advantage: none``, since v1's OPD advantage had no task-reward term; a
self-hosted teacher's ranks are ``backend.options.teacher_world_size``.
"""

from __future__ import annotations

from typing import Any

from nexrl_core.v1.convert import TEACHER_SERVICE, TRAIN_SERVICE, Converter
from nexrl_core.v1.reading import number, ranks
from nexrl_core.v1.table import ABSENT

__all__ = ["distillation", "names_a_teacher", "opd_trainer"]

ESTIMATOR = "on_policy_distillation"
LISTED = "trainer.teachers"
ALGORITHM = "trainer.algorithm.type"
COEFFICIENTS = {
    "trainer.algorithm.distillation_coeff": "algorithm.advantage.options.kl_coef",
    f"{TRAIN_SERVICE}.config.kl_penalty_coef": "algorithm.advantage.options.kl_coef",
    f"{TRAIN_SERVICE}.config.kl_discount_factor": "algorithm.advantage.options.kl_discount",
}
"""v1's distillation settings and the estimator options they become."""
TEACHER_MODEL = {"workers": f"{TEACHER_SERVICE}.actor.model.path", "service": f"{TEACHER_SERVICE}.config.model"}
"""Where a v1.4 teacher service names its model, by the kind of run."""
ENTRY_KEYS = {"base_model", "model", "checkpoint"}
"""What a ``trainer.teachers`` entry may hold: the model (either spelling) and an unset checkpoint."""


def opd_trainer(converter: Converter) -> bool:
    """Whether v1's trainer is one of its on-policy distillation trainers."""
    return str(converter.value("trainer.type")).endswith("_opd")


def _service_keys(converter: Converter) -> list[str]:
    return [key for key in converter.leaves if key.startswith(f"{TEACHER_SERVICE}.")]


def names_a_teacher(converter: Converter) -> bool:
    """Whether the recipe names a teacher, in either of v1's places."""
    return LISTED in converter.leaves or bool(_service_keys(converter))


def _listed_model(converter: Converter) -> tuple[str | None, str]:
    """The one ``trainer.teachers`` entry's model, or None and why it cannot be carried."""
    listed = converter.value(LISTED)
    if not isinstance(listed, list) or len(listed) != 1:
        count = len(listed) if isinstance(listed, list) else "not a list"
        return None, f"NexRL distils from one teacher, and this is {count}; instead: keep the one entry to distil from"
    (entry,) = listed
    if isinstance(entry, str) and entry:
        return entry, ""
    if not isinstance(entry, dict):
        return None, f"an entry is a model name or a mapping with base_model, got {entry!r}; instead: write the teacher's base_model"
    model, stray = entry.get("base_model", entry.get("model")), sorted(set(entry) - ENTRY_KEYS)
    if stray:
        return (
            None,
            f"the entry's {stray} have no NexRL counterpart (it reads {sorted(ENTRY_KEYS)}); instead: name the teacher by its base_model",
        )
    if entry.get("checkpoint"):
        return None, (
            "a teacher from a v1 checkpoint; NexRL's teacher is a base model the backend samples or a local Hugging Face "
            "directory; instead: export the checkpoint's weights as a Hugging Face directory and name it in teacher.model"
        )
    if not isinstance(model, str) or not model:
        return None, "the entry names no model; instead: write its base_model"
    return model, ""


def _placement_problem(converter: Converter) -> str:
    """Why the converted backend cannot hold this teacher, or ''."""
    if converter.profile.no_teacher:
        return converter.profile.no_teacher
    student, teacher = converter.value(f"{TRAIN_SERVICE}.backend"), converter.value(f"{TEACHER_SERVICE}.backend")
    if teacher is not ABSENT and teacher != student:
        return f"the teacher's backend is {teacher} and the student's {student}; NexRL holds both on the student's; instead: give both one backend"
    if converter.kind == "workers" and converter.present(f"{TRAIN_SERVICE}.url"):
        return (
            "NexRL starts the teacher's worker group itself, beside the student's, and this student runs on workers started by hand "
            f"({converter.name(f'{TRAIN_SERVICE}.url')}); instead: remove both services' url, so that NexRL starts both groups"
        )
    return ""


def _teacher(converter: Converter) -> bool:
    """Carry the teacher, or refuse it by its first key and drop the rest with it; whether it was carried."""
    service = _service_keys(converter)
    listed = LISTED in converter.leaves
    if listed and service:
        converter.refuse(LISTED, "a second teacher beside the train service of role teacher; NexRL distils from one", "keep one")
        listed = False
    model_key = LISTED if listed else TEACHER_MODEL[converter.kind]
    model, problem = _listed_model(converter) if listed else (converter.value(model_key), "")
    if not listed and model is ABSENT:
        model, problem = None, f"the teacher's service names no model ({converter.name(model_key)})"
    problem = problem or _placement_problem(converter)
    first = model_key if model_key in converter.leaves else (service or [LISTED])[0]
    if problem:
        why, _, instead = problem.partition("; instead: ")
        converter.refuse(first, why, instead or "name the teacher's model")
        for key in [LISTED, *service]:
            converter.drop(key, "part of the teacher, which is not supported (above)")
        return False
    converter.carry(model_key, {"teacher.model": model})
    ranks(converter, TEACHER_SERVICE, "backend.options.teacher_world_size")
    converter.drop(f"{TEACHER_SERVICE}.role", "the teacher's role; the service became teacher.model")
    converter.drop(f"{TEACHER_SERVICE}.identifier", "NexRL names the teacher's worker group teacher")
    converter.drop(f"{TEACHER_SERVICE}.backend", "the student's backend holds the teacher")
    converter.drop(f"{TEACHER_SERVICE}.url", "NexRL starts the teacher's group on the student's workers' API")
    return True


def _advantage(converter: Converter, distilling: bool) -> None:
    """``trainer.algorithm.type``: grpo, or, under v1's OPD trainers, the teacher's reverse KL alone."""
    if distilling:
        converter.carry(
            ALGORITHM,
            {"algorithm.advantage.name": ESTIMATOR, "algorithm.advantage.options.task_advantage": "none"},
            note=f"v1's {converter.value('trainer.type')} computed the advantage from the teacher alone",
        )
        return
    value = converter.value(ALGORITHM)
    if value == "grpo":
        converter.carry(ALGORITHM, {"algorithm.advantage.name": "grpo"})
    elif value is not ABSENT:
        converter.refuse(ALGORITHM, f"v1 value {value!r} has no NexRL counterpart", "choose algorithm.advantage.name yourself")


def _coefficients(converter: Converter, distilling: bool) -> None:
    for key, new in COEFFICIENTS.items():
        value: Any = converter.value(key)
        if value is ABSENT:
            continue
        if not distilling:
            converter.drop(key, "read only by v1's OPD trainers, with a teacher NexRL carries")
            continue
        if number(converter, key, value) is None:
            continue
        if new.endswith("kl_coef") and value <= 0:
            converter.refuse(key, f"a reverse-KL weight of {value} distils nothing", "a weight above 0 (v1's default is 1.0)")
            continue
        converter.carry(key, {new: value})


def distillation(converter: Converter) -> None:
    """The teacher, the estimator and its weights, under v1's OPD trainers; elsewhere v1 read none of them."""
    distilling = opd_trainer(converter) and names_a_teacher(converter) and _teacher(converter)
    if not opd_trainer(converter):
        trainer = converter.value("trainer.type")
        named = "" if trainer is ABSENT else f" ({trainer})"
        for key in [LISTED, *_service_keys(converter)]:
            converter.drop(key, f"v1's trainer{named} reads no teacher; only its OPD trainers do")
    _advantage(converter, distilling)
    _coefficients(converter, distilling)
