"""A task's items read the same from JSON lines, parquet, a ``datasets`` directory and a
``load_dataset`` spec; bad data is refused before anything starts, by file and column.

The rows are in verl's layout (a ``prompt`` column of chat messages, the answer under
``reward_model.ground_truth``). The slow test trains one step of the tiny model from
each form and gets the same rewards.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from importlib.resources import as_file, files
from pathlib import Path
from typing import Any

import pytest

from nexrl_core.config import ConfigError, TaskConfig, load_config
from nexrl_core.config.schema import DatasetSpec
from nexrl_core.run.data import resolve_task
from nexrl_core.run.loop import run_training

NEXRL = str(Path(sys.executable).with_name("nexrl"))
COLUMNS = ["prompt", "reward_model.ground_truth"]
AGENT = """
def solve(item, llm):
    reply = llm.chat.completions.create(messages=item["prompt"])
    return float((reply.choices[0].message.content or "").strip() == item["reward_model"]["ground_truth"])
"""


def verl_rows(count: int, offset: int = 0) -> list[dict[str, Any]]:
    """Two-digit sums in verl's parquet layout."""
    rows = []
    for index in range(offset, offset + count):
        a, b = (index * 37) % 90 + 10, (index * 53) % 90 + 5
        rows.append(
            {
                "data_source": "addition",
                "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"index": index, "split": "train"},
            }
        )
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_saved_dataset(path: Path, rows: list[dict[str, Any]]) -> Path:
    import datasets

    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


@pytest.fixture(scope="module")
def forms(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same 40 training rows in every form, each named ``train`` (task ids fall back on the name)."""
    import datasets

    rows = verl_rows(40)
    root = tmp_path_factory.mktemp("forms")
    for name in ("jsonl", "parquet", "dataset", "dict", "builder"):
        (root / name).mkdir()
    dict_dir = root / "dict" / "train"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(verl_rows(5, offset=100))}
    ).save_to_disk(str(dict_dir))
    write_parquet(root / "builder" / "part-0.parquet", rows[:25])
    write_parquet(root / "builder" / "part-1.parquet", rows[25:])
    return {
        "rows": rows,
        "jsonl": str(write_jsonl(root / "jsonl" / "train.jsonl", rows)),
        "parquet": str(write_parquet(root / "parquet" / "train.parquet", rows)),
        "dataset": str(write_saved_dataset(root / "dataset" / "train", rows)),
        "dict": DatasetSpec(path=str(dict_dir), split="train"),
        "builder": DatasetSpec(
            builder="parquet", data_files=[str(root / "builder" / "part-0.parquet"), str(root / "builder" / "part-1.parquet")]
        ),
    }


FORMS = ("jsonl", "parquet", "dataset", "dict", "builder")


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """load_dataset's cache goes to a temporary directory, not the user's."""
    import datasets

    cache = tmp_path_factory.getbasetemp() / "hf-datasets-cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    return cache


def task_for(source: Any, **fields: Any) -> TaskConfig:
    return TaskConfig(data_path=source, agent="json:dumps", columns=COLUMNS, **fields)


@pytest.mark.parametrize("form", FORMS)
def test_every_form_yields_the_same_items_in_the_same_order(forms: dict[str, Any], form: str) -> None:
    task = resolve_task(task_for(forms[form], val_data_path=forms[form]), seed=3)
    expected = [(row, f"train:{index}") for index, row in enumerate(forms["rows"])]
    assert task.val_items == expected
    reference = resolve_task(task_for(forms["jsonl"]), seed=3)
    assert task.train.take(0, 60) == reference.train.take(0, 60)  # the seeded order, across an epoch


def test_a_dataset_dict_directory_reads_the_split_named(forms: dict[str, Any]) -> None:
    spec = forms["dict"]
    task = resolve_task(task_for(spec, val_data_path=DatasetSpec(path=spec.path, split="test")), seed=0)
    assert [item for item, _ in task.val_items] == verl_rows(5, offset=100)


def test_a_relative_data_file_is_found_beside_the_recipe(forms: dict[str, Any]) -> None:
    parquet = Path(forms["parquet"])
    task = resolve_task(task_for(DatasetSpec(builder="parquet", data_files=["*.parquet"])), seed=0, recipe_dir=parquet.parent)
    assert task.train.take(0, 40) == resolve_task(task_for(forms["parquet"]), seed=0).train.take(0, 40)


def refusal(source: Any, recipe_dir: Path | None = None, **fields: Any) -> str:
    with pytest.raises(ConfigError) as caught:
        resolve_task(task_for(source, **fields), seed=0, recipe_dir=recipe_dir)
    return str(caught.value)


def test_a_missing_column_is_refused_naming_the_file_and_the_column(tmp_path: Path) -> None:
    rows = [{key: value for key, value in row.items() if key != "reward_model"} for row in verl_rows(3)]
    path = write_parquet(tmp_path / "no_answers.parquet", rows)
    message = refusal(str(path))
    assert f"task.data_path: {path} has no column 'reward_model.ground_truth'" in message
    assert "its columns: data_source, extra_info, prompt" in message


def test_an_item_without_a_nested_value_is_refused_with_its_position(tmp_path: Path) -> None:
    rows = verl_rows(4)
    rows[2]["reward_model"] = {"style": "rule", "ground_truth": None}
    path = write_parquet(tmp_path / "gap.parquet", rows)
    message = refusal(str(path))
    assert f"task.data_path: {path}: item 2 has no value for column 'reward_model.ground_truth'" in message
    assert "1 of 4 items lack it" in message


def test_the_held_out_file_is_checked_too(forms: dict[str, Any], tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "val.jsonl", [{"question": "1+1="}])
    message = refusal(forms["parquet"], val_data_path=str(path))
    assert f"task.val_data_path: {path} has no column 'prompt'" in message


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp: write_jsonl(tmp / "empty.jsonl", []), "task.data_path: {path} holds no items"),
        (lambda tmp: _write(tmp / "junk.parquet", b"not parquet at all"), "task.data_path: cannot read '{path}' as parquet"),
        (lambda tmp: _write(tmp / "latin1.jsonl", b'{"a": "\xe9"}\n'), "task.data_path: cannot read '{path}'"),
        (lambda tmp: write_parquet(tmp / "empty.parquet", []), "task.data_path: {path} holds no items"),
        (lambda tmp: (tmp / "plain").mkdir() or tmp / "plain", "is a directory but not one save_to_disk wrote"),
    ],
    ids=["empty-jsonl", "unreadable-parquet", "undecodable-jsonl", "empty-parquet", "plain-directory"],
)
def test_unreadable_or_empty_files_are_refused_by_name(tmp_path: Path, make: Any, message: str) -> None:
    path = make(tmp_path)
    assert message.format(path=path) in refusal(str(path))


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_an_empty_split_is_refused(tmp_path: Path) -> None:
    import datasets

    saved = tmp_path / "saved"
    train = datasets.Dataset.from_list(verl_rows(3))
    datasets.DatasetDict({"train": train, "test": train.select([])}).save_to_disk(str(saved))
    message = refusal(DatasetSpec(path=str(saved), split="test"))
    assert f"task.data_path: {saved} (split test) holds no items" in message


def test_split_problems_are_refused_listing_the_splits(forms: dict[str, Any]) -> None:
    directory = forms["dict"].path
    assert "holds the splits train, test; choose one" in refusal(DatasetSpec(path=directory))
    assert "has no split 'validation'; its splits: train, test" in refusal(DatasetSpec(path=directory, split="validation"))
    assert "split applies to a datasets directory or a builder" in refusal(DatasetSpec(path=forms["parquet"], split="train"))


def test_builders_read_local_files_only(tmp_path: Path, forms: dict[str, Any]) -> None:
    assert "task.data_path.builder: 'gsm8k' is neither a packaged builder" in refusal(DatasetSpec(builder="gsm8k"))
    assert "task.data_path.data_files: 'nowhere/*.parquet' matches no file" in refusal(
        DatasetSpec(builder="parquet", data_files=["nowhere/*.parquet"]), recipe_dir=tmp_path
    )
    assert "task.data_path.data_files: builder 'json' needs the files to read" in refusal(DatasetSpec(builder="json"))
    bad = _write(tmp_path / "bad.jsonl", b"{not json\n")
    assert "task.data_path: load_dataset('json', split='train') failed" in refusal(DatasetSpec(builder="json", data_files=[str(bad)]))


def test_a_recipe_takes_a_dataset_spec_and_nexrl_train_refuses_a_bad_file_before_it_starts(tmp_path: Path) -> None:
    write_parquet(tmp_path / "train.parquet", [{"question": "1+1="}])
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "task:\n"
        "  data_path: {builder: parquet, data_files: [train.parquet]}\n"
        "  columns: [prompt]\n"
        "  agent: json:dumps\n"
        "backend: {name: inprocess}\n"
        "model: {name: nexrl-tiny}\n"
        f"output: {{dir: {tmp_path / 'run'}}}\n"
    )
    assert load_config(recipe, []).task.data_path == DatasetSpec(builder="parquet", data_files=["train.parquet"])
    done = subprocess.run([NEXRL, "train", str(recipe)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "task.data_path: load_dataset('parquet', split='train') has no column 'prompt'" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "run").exists()


# --- one training step from each form ----------------------------------------------------------------


def one_step(out_dir: Path, source: str, agent_dir: Path) -> Mapping[str, Any]:
    overrides = [
        f"output.dir={out_dir}",
        "backend.name=inprocess",
        "backend.options={}",
        f"task.data_path={source}",
        "task.agent=verl_agent:solve",
        f"task.columns={json.dumps(COLUMNS)}",
        "schedule.steps=1",
        "schedule.validate_every=0",
        "rollout.prompts_per_step=8",
        "rollout.group_size=4",
    ]
    with as_file(files("nexrl_core").joinpath("recipes", "quickstart.yaml")) as path:
        config = load_config(path, overrides)
    summary = run_training(config, recipe_dir=agent_dir, progress_bar=False)
    assert summary.last_row is not None
    return summary.last_row


@pytest.mark.slow
def test_one_training_step_gets_the_same_rewards_from_every_form(forms: dict[str, Any], tmp_path: Path) -> None:
    (tmp_path / "verl_agent.py").write_text(AGENT)
    rewards = {}
    for form in ("jsonl", "parquet", "dataset"):
        row = one_step(tmp_path / form, forms[form], tmp_path)
        rewards[form] = (row["reward/mean"], row["reward/std"], row["rollout/response_tokens"])
    assert rewards["jsonl"] == rewards["parquet"] == rewards["dataset"], rewards
    assert 0.0 < rewards["jsonl"][0] < 1.0, "the tiny model solves some sums, so equal rewards say something"
