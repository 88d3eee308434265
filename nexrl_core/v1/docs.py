"""``docs/coming-from-v1.md``, rendered from the key table the converter uses.

``python -m nexrl_core.v1.docs > docs/coming-from-v1.md`` rewrites the page; a test
checks that the page in the repository is what this renders, so the page says what
`nexrl convert-v1` does and nothing else. NexRL's own defaults in "Defaults that differ"
are read from the installed components (``nexrl config show`` of a recipe on each
backend), so they cannot drift either, and the launch-line table is what `nexrl
convert-v1 --launch` prints for the design documents' lines.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import yaml

from nexrl_core.v1.convert import Conversion, convert_v1_recipe, show
from nexrl_core.v1.launch import convert_launch
from nexrl_core.v1.table import ABSENT, Fate, KeyRule, KeyTable, Profile, key_table

INTRO = """\
# Coming from NexRL v1

`nexrl convert-v1` reads a NexRL v1 recipe as v1 read it (the Hydra `defaults:` list
composed from the recipe's folder, `${a.b}` interpolations resolved) and writes a NexRL
recipe:

```bash
nexrl convert-v1 recipe/math/self_hosted.yaml -o math.yaml      # the recipe, and what became of every key
nexrl config show math.yaml                                      # every value the run will use
nexrl train math.yaml
```

It lists on standard error each key it **carried** (v1 key -> NexRL key = value), each it
**dropped** (infrastructure with no meaning here, with why) and each it does **not
support** (it changes training in a way NexRL cannot, with what to do instead). A key the
table below does not list stops the conversion with the key named. With a key not
supported it writes nothing and exits with status 2; `--drop-unsupported` writes the
recipe without those keys. Where a recipe leaves out a key that changes training, v1's
default is written, so nothing silently becomes a NexRL default that differs.

Where v1 trained otherwise than its recipe says (a KL controller where v1 never read it,
a setting v1 never sent to the service), the converted recipe holds what the recipe
says, and a **choose** line (also at the top of the written file) says what v1 did and
which value trains as v1 did.

v1's rollout workers run no code NexRL has: port the agent to a function that takes
`(item, llm)` and returns the reward (`examples/math/math_agent.py` does the
`single_turn_math` agent's job) and name it with `--agent module:function`, which sets
`task.agent`.

`${oc.env:NAME}` and `${oc.env:NAME,default}` stay environment references: the recipe
loader resolves them when the run starts (a value that is one reference is read as YAML,
so `${oc.env:STEPS,10}` is a number). A key held in the environment becomes
`backend.options.api_key_env: NAME`; a key written in a v1 recipe is never copied.

## Shapes

v1 recipes come in three shapes, and the table below writes the train service's keys
the one way they are brought to:

- the design documents': `trainer.train_service.*`, with the workers' settings in the
  file `training_config_path` names (its `actor.*` is `train_service.actor.*` below);
- v1's: `service.train_service.*`, resources under `resource.*`;
- v1.4's: `service.train_service.<name>.*` per model, with `role`, `backend`, `resource`
  and `actor` or `config`; the `role: actor` service is the student, the one of
  `role: teacher` is written `teacher_service.*` below, and any other is reported as not
  supported.

Under v1's distillation trainers (`remote_api_opd`, `self_hosted_opd`) the teacher,
from `trainer.teachers` (one entry: a model name, or a mapping with `base_model`) or
from the `role: teacher` service, becomes `teacher.model` (and, on self-hosted workers,
`backend.options.teacher_world_size` from its resources), and the advantage becomes
`on_policy_distillation` with `task_advantage: none`, as v1's advantage was the
teacher's reverse KL alone. Under any other trainer v1 read no teacher, so its keys are
dropped.

A key ending in `.*` stands for every key under it.
"""


LAUNCH_INTRO = """\
## Launch lines

`nexrl convert-v1 --launch '<v1 command line>'` (repeatable) prints the NexRL command
lines for v1's launch lines, on standard output, in the order to run them; this table is
what it prints. A flag it does not know, a Hydra override on the trainer's line (write it
into the v1 recipe before converting it) and a value NexRL cannot honour are named, and
then it prints nothing and exits with status 2.

`python -m nexrl_fsdp.worker` takes v1's worker flags as they were written: `--backend
fsdp` (the only value: the ranks are FSDP2) and `--dispatch-mode scatter`, which is what
the ranks always do (rank 0 takes each batch from the driver and scatters its rows over
the ranks). `--dispatch-mode broadcast` is refused with that reason (v1's own client
refused broadcast groups too). Without `--api-server-url` it reads `API_SERVER_URL`, as
v1's workers did: a URL, `HOST:PORT` or a bare host (then port 8000, v1's and `nexrl
serve`'s default); with neither, it exits naming both. `NEXRL_WORKER_IP` and
`NEXRL_WORKER_DATA_BASE_PORT` are read as v1 read them. The trainer finds the API server
at the recipe's `train_service.url`, which becomes `backend.options.workers_url` (an
`${oc.env:API_SERVER_URL}` in it stays a reference). Every NexRL line needs the run's key
in `NEXRL_WORKER_KEY` (see [self-hosted.md](self-hosted.md)).
"""

LAUNCH_EXAMPLES = (
    "python -m nexrl.main --config-path=recipe/math --config-name=self_hosted",
    "python -m nexrl.train_service_backend.api.api_server --host 0.0.0.0 --port 8000",
    "torchrun --nproc_per_node=8 -m nexrl.train_service_backend.distributed.worker_process "
    "--api-server-url http://localhost:8000 --identifier actor-group --backend fsdp",
    "API_SERVER_URL=10.0.0.1 torchrun --standalone --nproc_per_node=1 -m nexrl.train_service_backend.distributed.worker_process "
    "--identifier=actor-group --backend=fsdp --dispatch-mode=scatter",
)
"""The design documents' launch lines (and v1's bare-host ``API_SERVER_URL`` form)."""


def _code(text: str) -> str:
    return f"`{text}`"


def _value(value: Any) -> str:
    return f"`{show(value)}`"


def _kinds(rule: KeyRule, profiles: tuple[Profile, ...]) -> str:
    if not rule.kinds:
        return ""
    return " Only on " + " or ".join(profile.about for profile in profiles if profile.kind in rule.kinds) + "."


def _what(rule: KeyRule, profiles: tuple[Profile, ...]) -> str:
    default = f" v1 default {_value(rule.v1_default)}." if rule.v1_default is not ABSENT else ""
    if rule.fate is Fate.DROPPED:
        return f"dropped: {rule.why}"
    if rule.fate is Fate.UNSUPPORTED:
        inert = f" (dropped when {' or '.join(_value(value) for value in rule.inert)}: {rule.inert_why})" if rule.inert else ""
        return f"not supported: {rule.why}; instead: {rule.instead}{inert}"
    note = f": {rule.why}." if rule.why else "."
    values = " Values: " + ", ".join(f"{_value(old)} -> {_value(new)}" for old, new in rule.values.items()) + "." if rule.values else ""
    verb = "read" if rule.fate is Fate.RULE and not rule.new else "carried"
    return f"{verb}{note}{values}{default}{_kinds(rule, profiles)}"


def _launch_lines() -> list[str]:
    """The launch-line table, each NexRL cell what `convert_launch` prints for its v1 line."""
    lines = [LAUNCH_INTRO.rstrip("\n"), "", "| v1 | NexRL |", "|---|---|"]
    for example in LAUNCH_EXAMPLES:
        converted = "<br>".join(_code(line) for line in convert_launch(example).lines())
        lines.append(f"| {_code(example)} | {converted} |")
    return lines


def _profiles(table: KeyTable) -> list[str]:
    lines = [
        "## Backends",
        "",
        "`train_service.backend` decides what the converted recipe runs on:",
        "",
        "| v1 backend | NexRL |",
        "|---|---|",
    ]
    for profile in table.profiles:
        backend = profile.backend
        options = ", ".join(f"{key}: {value}" for key, value in backend.get("options", {}).items())
        extra = ""
        if profile.hosted_url:
            extra += f"; a null `base_url` meant the hosted service, written as {_code(profile.hosted_url)}"
        if profile.api_key_env:
            extra += f"; its key is read from {_code(profile.api_key_env)}"
        if profile.unsent:
            unsent = ", ".join(f"{_code(key.rsplit('.', 1)[1])} (it used {_value(value)})" for key, value in profile.unsent.items())
            extra += f"; v1 never sent it {unsent}"
        lines.append(f"| {', '.join(_code(name) for name in profile.v1_backends)} | `backend.name: {backend['name']}` ({options}){extra} |")
    return lines


def _minimal_conversion(profile: Profile) -> Conversion:
    """What the converter writes for a v1 recipe that names only ``profile``'s backend:
    v1's default for every key that changes training."""
    with tempfile.TemporaryDirectory() as folder:
        recipe = Path(folder) / "recipe.yaml"
        recipe.write_text(yaml.safe_dump({"service": {"train_service": {"backend": profile.v1_backends[0]}}}))
        return convert_v1_recipe(recipe)


def _nexrl_default(profile: Profile, recipe: dict[str, Any], new: str) -> Any:
    """NexRL's default for ``new`` on ``profile``'s backend with the loss ``recipe`` chose."""
    from nexrl_core.commands.config import resolved_config_data

    backend = profile.backend
    overrides = [f"backend.name={backend['name']}"]
    overrides += [f"backend.options.{key}={value}" for key, value in backend.get("options", {}).items()]
    loss = recipe.get("algorithm", {}).get("loss", {}).get("name")
    if loss:
        overrides.append(f"algorithm.loss.name={loss}")
    node: Any = resolved_config_data(None, overrides)
    for part in new.split("."):
        if not isinstance(node, dict) or part not in node:
            return ABSENT
        node = node[part]
    return node


def _defaults(table: KeyTable) -> list[str]:
    lines = [
        "## Defaults that differ",
        "",
        "What v1 trained with where a recipe leaves a key out, which the converter writes, against NexRL's own default:",
        "",
        "| v1 trained on | v1 key | NexRL key | v1's value (written) | NexRL default |",
        "|---|---|---|---|---|",
    ]
    for profile in table.profiles:
        conversion = _minimal_conversion(profile)
        for carried in conversion.carried:
            if not carried.from_default:
                continue
            for new, value in carried.assignments.items():
                ours = _nexrl_default(profile, conversion.recipe, new)
                if ours != value:
                    shown = "-" if ours is ABSENT else _value(ours)
                    lines.append(f"| {profile.about} | {_code(carried.key)} | {_code(new)} | {_value(value)} | {shown} |")
    return lines


def render_page(table: KeyTable | None = None) -> str:
    """The whole page, as Markdown."""
    table = table or key_table()
    lines = [INTRO.rstrip("\n"), "", *_launch_lines(), "", *_profiles(table), "", *_defaults(table), "", "## Every v1 key", ""]
    for section in table.sections:
        lines += [f"### {section.title}", "", "| v1 key | NexRL key | what happens |", "|---|---|---|"]
        for rule in section.keys:
            new = ", ".join(_code(key) for key in rule.new) or "-"
            lines.append(f"| {_code(rule.v1)} | {new} | {_what(rule, table.profiles)} |")
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":
    print(render_page(), end="")
