"""Read a task's items from the files users already have.

``task.data_path`` and ``task.val_data_path`` name JSON lines, a parquet file (verl's
layout: a ``prompt`` column of chat messages beside the fields the agent reads), a
directory Hugging Face ``datasets`` wrote with ``save_to_disk``, or a ``load_dataset``
call on local files (a `DatasetSpec`). Every form yields the same thing, a list of plain
dicts in file order, so a task reads the same items whichever form it ships in.

Everything is read, and every item checked for the recipe's ``task.columns``, before a
run starts anything; a problem names the recipe key, the file and the column. pyarrow
and ``datasets`` are imported only when a file needs them (``pip install 'nexrl[data]'``).
"""

from __future__ import annotations

import glob
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nexrl_core.config.errors import ConfigError
from nexrl_core.config.schema import DatasetSpec

PARQUET_SUFFIXES = (".parquet", ".pq")
PARQUET_MAGIC = b"PAR1"
DATASET_DIR_FILES = ("dataset_info.json", "state.json")
"""What ``Dataset.save_to_disk`` leaves in its directory."""
DATASET_DICT_FILE = "dataset_dict.json"
"""What ``DatasetDict.save_to_disk`` leaves in its directory."""
INSTALL_HINT = "install it with: pip install 'nexrl[data]'"
MISSING = object()


def read_jsonl(path: Path, key: str) -> list[dict[str, Any]]:
    """Read a JSONL file of objects (blank lines skipped).

    :param key: the recipe key that named the file, for error messages.
    :raises ConfigError: when the file is missing, empty, or a line is not a JSON object.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or error
        raise ConfigError([f"{key}: cannot read {str(path)!r}: {reason}"]) from None
    items = []
    problems = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as error:
            problems.append(f"{key}: {path}: line {number} is not valid JSON ({error.msg})")
            continue
        if not isinstance(value, dict):
            problems.append(f"{key}: {path}: line {number} must be a JSON object, got {type(value).__name__}")
            continue
        items.append(value)
    if problems:
        raise ConfigError(problems[:10] + ([f"... and {len(problems) - 10} more"] if len(problems) > 10 else []))
    return items


def _is_parquet(path: Path) -> bool:
    if path.suffix.lower() in PARQUET_SUFFIXES:
        return True
    try:
        with path.open("rb") as handle:
            return handle.read(len(PARQUET_MAGIC)) == PARQUET_MAGIC
    except OSError:
        return False


def read_parquet(path: Path, key: str) -> list[dict[str, Any]]:
    """Every row of a parquet file as a dict (nested structs and lists as dicts and lists)."""
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise ConfigError([f"{key}: {path} is parquet, which needs pyarrow; {INSTALL_HINT}"]) from None
    try:
        rows: list[dict[str, Any]] = parquet.read_table(path).to_pylist()
        return rows
    except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError
        raise ConfigError([f"{key}: cannot read {str(path)!r} as parquet: {error}"]) from None


def _import_datasets(key: str, what: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise ConfigError([f"{key}: {what} needs the datasets package; {INSTALL_HINT}"]) from None
    return datasets


def _pick_split(splits: Sequence[str], split: str | None, key: str, where: Path) -> str:
    names = ", ".join(splits)
    if split is None:
        if len(splits) == 1:
            return splits[0]
        raise ConfigError([f"{key}: {where} holds the splits {names}; choose one with {{path: ..., split: NAME}}"])
    if split not in splits:
        raise ConfigError([f"{key}: {where} has no split {split!r}; its splits: {names}"])
    return split


def read_saved_dataset(path: Path, split: str | None, key: str) -> list[dict[str, Any]]:
    """The rows of a directory ``Dataset.save_to_disk`` wrote, or of one split of a
    ``DatasetDict.save_to_disk`` directory (only that split is loaded)."""
    datasets = _import_datasets(key, f"the datasets directory {path}")
    directory = path
    try:
        if (path / DATASET_DICT_FILE).is_file():
            splits = json.loads((path / DATASET_DICT_FILE).read_text(encoding="utf-8"))["splits"]
            directory = path / _pick_split(splits, split, key, path)
        state = json.loads((directory / DATASET_DIR_FILES[1]).read_text(encoding="utf-8"))
        if not state.get("_data_files"):
            return []  # datasets saves an empty dataset as no shard at all, and cannot load that back
        loaded = datasets.load_from_disk(str(directory))
    except ConfigError:
        raise
    except Exception as error:  # a damaged directory fails in many ways inside datasets; all are the data's fault
        raise ConfigError([f"{key}: cannot read {str(directory)!r} as a saved dataset: {type(error).__name__}: {error}"]) from None
    if directory == path and split is not None and str(loaded.split) != split:
        raise ConfigError([f"{key}: {path} holds one dataset (split {loaded.split}), not a DatasetDict; remove split: {split}"])
    saved: list[dict[str, Any]] = loaded.to_list()
    return saved


def _resolve_files(patterns: Sequence[str], key: str, recipe_dir: Path | None) -> list[str]:
    """Each file or glob, looked up from the current directory, then from the recipe's."""
    resolved = []
    for pattern in patterns:
        candidates = [Path(pattern).expanduser()]
        if not candidates[0].is_absolute() and recipe_dir is not None:
            candidates.append(recipe_dir / pattern)
        found = next((str(candidate) for candidate in candidates if glob.glob(str(candidate))), None)
        if found is None:
            raise ConfigError([f"{key}.data_files: {pattern!r} matches no file"])
        resolved.append(found)
    return resolved


def _packaged_builders() -> set[str]:
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

    return set(_PACKAGED_DATASETS_MODULES)


def read_builder(spec: DatasetSpec, key: str, recipe_dir: Path | None) -> list[dict[str, Any]]:
    """The rows ``datasets.load_dataset(builder, data_files=..., split=...)`` gives, on local files only."""
    assert spec.builder is not None
    datasets = _import_datasets(key, f"builder {spec.builder!r}")
    split = spec.split or "train"
    builder = spec.builder
    local = find_path(builder, recipe_dir)
    if local.is_dir():
        builder = str(local)
    elif builder not in _packaged_builders():
        raise ConfigError(
            [
                f"{key}.builder: {spec.builder!r} is neither a packaged builder ({', '.join(sorted(_packaged_builders()))}) "
                "nor a local directory; NexRL reads local data only: download the dataset and save_to_disk it, "
                "or point builder and data_files at its files"
            ]
        )
    elif not spec.data_files:
        raise ConfigError([f"{key}.data_files: builder {builder!r} needs the files to read"])
    files = {split: _resolve_files(spec.data_files, key, recipe_dir)} if spec.data_files else None
    try:
        loaded = datasets.load_dataset(builder, data_files=files, split=split)
    except Exception as error:  # datasets raises many kinds (generation, split, file errors); all are the data's fault
        raise ConfigError([f"{key}: load_dataset({spec.builder!r}, split={split!r}) failed: {type(error).__name__}: {error}"]) from None
    saved: list[dict[str, Any]] = loaded.to_list()
    return saved


def find_path(value: str, recipe_dir: Path | None) -> Path:
    """A relative path is looked up from the current directory, then from the recipe's."""
    path = Path(value).expanduser()
    if path.is_absolute() or path.exists() or recipe_dir is None:
        return path
    beside = recipe_dir / path
    return beside if beside.exists() else path


def describe_source(source: str | DatasetSpec) -> str:
    """How error messages name a data source."""
    if isinstance(source, str):
        return source
    if source.path is not None:
        return source.path + (f" (split {source.split})" if source.split else "")
    return f"load_dataset({source.builder!r}, split={source.split or 'train'!r})"


def read_rows(source: str | DatasetSpec, key: str, recipe_dir: Path | None) -> tuple[list[dict[str, Any]], str]:
    """Every item of a data source, in order, and the name its task ids fall back on.

    :raises ConfigError: naming ``key`` and the file for a missing, unreadable or empty source.
    """
    spec = source if isinstance(source, DatasetSpec) else DatasetSpec(path=source)
    if spec.builder is not None:
        rows, stem = read_builder(spec, key, recipe_dir), spec.split or "train"
    else:
        assert spec.path is not None
        path = find_path(spec.path, recipe_dir)
        stem = path.stem
        if path.is_dir():
            if (path / DATASET_DICT_FILE).is_file() or all((path / name).is_file() for name in DATASET_DIR_FILES):
                rows = read_saved_dataset(path, spec.split, key)
            else:
                raise ConfigError(
                    [
                        f"{key}: {path} is a directory but not one save_to_disk wrote (no {DATASET_DICT_FILE} or "
                        f"{DATASET_DIR_FILES[0]}); for a folder of data files use {{builder: parquet, data_files: [...]}}"
                    ]
                )
        elif spec.split is not None:
            raise ConfigError([f"{key}: split applies to a datasets directory or a builder, not to the file {path}"])
        elif _is_parquet(path):
            rows = read_parquet(path, key)
        else:
            rows = read_jsonl(path, key)
    if not rows:
        raise ConfigError([f"{key}: {describe_source(source)} holds no items"])
    return rows, stem


def column_value(item: Mapping[str, Any], column: str) -> Any:
    """The value at a dotted column path (``reward_model.ground_truth``), or `MISSING`."""
    value: Any = item
    for part in column.split("."):
        if not isinstance(value, Mapping) or value.get(part) is None:
            return MISSING
        value = value[part]
    return value


def check_columns(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], key: str, where: str) -> None:
    """Every row has every column (a null counts as missing: parquet fills absent fields with nulls).

    :raises ConfigError: naming ``key``, the file and each missing column.
    """
    problems = []
    for column in columns:
        missing = [index for index, row in enumerate(rows) if column_value(row, column) is MISSING]
        if not missing:
            continue
        if len(missing) == len(rows):
            present = ", ".join(sorted({name for row in rows[:100] for name in row}))
            problems.append(f"{key}: {where} has no column {column!r} (task.columns lists it; its columns: {present})")
        else:
            problems.append(
                f"{key}: {where}: item {missing[0]} has no value for column {column!r} "
                f"(task.columns lists it; {len(missing)} of {len(rows)} items lack it)"
            )
    if problems:
        raise ConfigError(problems)
