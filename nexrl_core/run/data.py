"""Where a run's prompts come from, and how each becomes a group of agent runs.

A recipe names a registered task (``task.name``) or gives a JSONL file of items and an
agent function (``task.data_path``, ``task.agent``). Either way `resolve_task` returns a
`TaskData`: a seeded, replayable stream of training items, the held-out items, and the
agent. The `DataLoader` cuts the stream into steps of ``prompts_per_step`` items and
repeats each ``group_size`` times as `RunRequest` records that share a ``group_id`` and
have ``run_id`` 0..n-1.

Every choice is a function of (seed, step, ...): the items of step k are the same
whether the run started at step 1 or was resumed at step k, and whatever order worker
threads take the requests in.
"""

from __future__ import annotations

import hashlib
import importlib
import itertools
import json
import random
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from nexrl_core.config.errors import ConfigError
from nexrl_core.config.schema import DatasetSpec, TaskConfig
from nexrl_core.run.data_files import check_columns, describe_source, read_rows
from nexrl_core.run.rollout import Agent, RunRequest
from nexrl_core.run.seeding import derive_seed

# --- item streams -------------------------------------------------------------------------------


def item_task_id(item: Mapping[str, Any], fallback: str | None = None) -> str:
    """An item's ``task_id`` or ``id`` field, else ``fallback``, else a hash of its content."""
    for key in ("task_id", "id"):
        value = item.get(key)
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            return str(value)
    if fallback is not None:
        return fallback
    text = json.dumps(item, sort_keys=True, default=str)
    return "item-" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


class ItemStream:
    """An endless sequence of training items that can be read from any position."""

    def take(self, position: int, count: int) -> list[tuple[Mapping[str, Any], str]]:
        """Items ``position .. position+count-1`` with their task ids."""
        raise NotImplementedError


class ListItems(ItemStream):
    """A finite dataset, reshuffled every epoch with a seed derived from (seed, epoch)."""

    def __init__(self, items: Sequence[Mapping[str, Any]], task_ids: Sequence[str], seed: int) -> None:
        if not items:
            raise ValueError("a dataset needs at least one item")
        self._items = list(items)
        self._task_ids = list(task_ids)
        self._seed = seed
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        order = self._orders.get(epoch)
        if order is None:
            order = list(range(len(self._items)))
            random.Random(derive_seed(self._seed, "data-epoch", epoch)).shuffle(order)
            self._orders = {epoch: order}  # keep one epoch; reads are sequential
        return order

    def take(self, position: int, count: int) -> list[tuple[Mapping[str, Any], str]]:
        size = len(self._items)
        taken = []
        for index in range(position, position + count):
            row = self._order(index // size)[index % size]
            taken.append((self._items[row], self._task_ids[row]))
        return taken


class TaskItems(ItemStream):
    """A registered task's ``train_items(seed)`` stream; a finite one restarts with a new seed.

    Epoch 0 reads ``train_items(seed)``, epoch e > 0 reads ``train_items(derive_seed(seed, e))``.
    Reading an earlier position than the last one replays the stream from the start, so a
    resumed run sees exactly the items an uninterrupted one would.
    """

    def __init__(self, train_items: Callable[[int], Iterator[Mapping[str, Any]]], seed: int) -> None:
        self._train_items = train_items
        self._seed = seed
        self._iterator: Iterator[Mapping[str, Any]] | None = None
        self._next = 0

    def _epochs(self) -> Iterator[Mapping[str, Any]]:
        for epoch in itertools.count():
            seed = self._seed if epoch == 0 else derive_seed(self._seed, "task-epoch", epoch)
            empty = True
            for item in self._train_items(seed):
                empty = False
                yield item
            if empty:
                raise ValueError(f"the task's train_items({seed}) yielded no items")

    def take(self, position: int, count: int) -> list[tuple[Mapping[str, Any], str]]:
        if self._iterator is None or position < self._next:
            self._iterator = self._epochs()
            self._next = 0
        for _ in itertools.islice(self._iterator, position - self._next):
            pass
        items = list(itertools.islice(self._iterator, count))
        self._next = position + count
        for item in items:
            if not isinstance(item, Mapping):
                raise TypeError(f"a task's train_items must yield mappings, got {type(item).__name__}")
        return [(item, item_task_id(item)) for item in items]


# --- tasks -------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class TaskData:
    """What the loop needs from a task: the agent, the training stream and held-out items."""

    name: str | None
    """The registered task's name; None for a task given by data file and agent."""
    agent: Agent = attrs.field(eq=False)
    train: ItemStream = attrs.field(eq=False)
    val_items: list[tuple[Mapping[str, Any], str]] = attrs.field(eq=False)
    """Held-out items with their task ids; empty when the task has none."""


def read_items(
    source: str | DatasetSpec, key: str, recipe_dir: Path | None, columns: Sequence[str] | None = None
) -> list[tuple[Mapping[str, Any], str]]:
    """Every item of ``source`` (any form `nexrl_core.run.data_files` reads) with its task id,
    after checking that each has the recipe's ``columns``."""
    rows, stem = read_rows(source, key, recipe_dir)
    if columns:
        check_columns(rows, columns, key, describe_source(source))
    return [(item, item_task_id(item, fallback=f"{stem}:{index}")) for index, item in enumerate(rows)]


def load_agent(reference: str, recipe_dir: Path | None = None) -> Agent:
    """Import ``package.module:function``; the recipe's directory and the current one are searched too.

    :raises ConfigError: naming ``task.agent`` when the module or attribute is missing.
    """
    module_name, _, attribute_path = reference.partition(":")
    for directory in (Path.cwd(), recipe_dir):
        if directory is not None and str(directory) not in sys.path:
            sys.path.append(str(directory))
    try:
        target: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise ConfigError([f"task.agent: cannot import module {module_name!r} ({error})"]) from None
    for part in attribute_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigError([f"task.agent: module {module_name!r} has no attribute {attribute_path!r}"]) from None
    if not callable(target):
        raise ConfigError([f"task.agent: {reference!r} is a {type(target).__name__}, not a callable"])
    agent: Agent = target
    return agent


def resolve_task(config: TaskConfig, seed: int, recipe_dir: Path | None = None) -> TaskData:
    """Build the task a recipe describes (see `TaskConfig`).

    - ``data_path`` set: training items come from that file (or dataset), the agent from
      ``agent`` (or, when that is null, from the registered task ``name``).
    - otherwise the registered task ``name`` provides items and agent (``agent`` may
      still replace its agent).
    - held-out items come from ``val_data_path``, else from the registered task, else
      there are none; ``val_size`` keeps the first n.

    :raises ConfigError: for a missing or unreadable file, a bad line, a missing column,
        an unknown task or agent.
    """
    from nexrl_core.plugins.registry import UnknownComponentError, find_spec

    registered: Any = None

    def registered_task() -> Any:
        nonlocal registered
        if registered is None:
            if config.name is None:
                raise ConfigError(["task: set task.name to a registered task, or task.data_path and task.agent for your own"])
            try:
                spec = find_spec("tasks", config.name)
            except UnknownComponentError as error:
                raise ConfigError([f"task.name: {error}"]) from None
            registered = spec.build()
        return registered

    if config.data_path is not None:
        rows = read_items(config.data_path, "task.data_path", recipe_dir, config.columns)
        train: ItemStream = ListItems([item for item, _ in rows], [task_id for _, task_id in rows], seed)
        if config.agent is None:
            try:
                agent = registered_task().agent
            except ConfigError:
                problem = "task.agent: required with task.data_path unless task.name is a registered task"
                raise ConfigError([problem]) from None
        else:
            agent = load_agent(config.agent, recipe_dir)
    else:
        task = registered_task()
        train = TaskItems(task.train_items, seed)
        agent = load_agent(config.agent, recipe_dir) if config.agent is not None else task.agent

    if config.val_data_path is not None:
        val_items = read_items(config.val_data_path, "task.val_data_path", recipe_dir, config.columns)
    elif config.name is not None:
        val_items = [(item, item_task_id(item, fallback=f"val:{index}")) for index, item in enumerate(registered_task().val_items())]
    else:
        val_items = []
    if config.val_size is not None:
        val_items = val_items[: config.val_size]
    return TaskData(name=config.name, agent=agent, train=train, val_items=val_items)


# --- grouping ----------------------------------------------------------------------------------


class DataLoader:
    """Cuts the item stream into steps and repeats each item ``group_size`` times."""

    def __init__(self, task: TaskData, prompts_per_step: int, group_size: int, seed: int) -> None:
        self.task = task
        self.prompts_per_step = prompts_per_step
        self.group_size = group_size
        self.seed = seed

    def position(self, step: int) -> int:
        """Stream position of the first item of ``step`` (1-based)."""
        return (step - 1) * self.prompts_per_step

    def requests(self, step: int) -> list[RunRequest]:
        """The runs of training step ``step``: every item ``group_size`` times, in order."""
        if step < 1:
            raise ValueError(f"training steps count from 1, got {step}")
        items = self.task.train.take(self.position(step), self.prompts_per_step)
        return [
            RunRequest(
                step=step,
                item_index=index,
                run_id=run_id,
                group_id=f"s{step}-p{index}",
                task_id=task_id,
                item=item,
                seed=derive_seed(self.seed, "train", step, index),
            )
            for index, (item, task_id) in enumerate(items)
            for run_id in range(self.group_size)
        ]

    def val_requests(self, step: int, samples: int = 1) -> list[RunRequest]:
        """``samples`` runs per held-out item (validation during training takes one).
        Seeds do not depend on ``step``, so every validation draws the same random numbers
        and differences between steps come from the weights; run 0 of an item is the same
        run whatever ``samples`` is, so ``nexrl eval`` reproduces a run's validation."""
        if samples < 1:
            raise ValueError(f"validation takes at least one sample per item, got {samples}")
        return [
            RunRequest(
                step=step,
                item_index=index,
                run_id=run_id,
                group_id=f"val-p{index}",
                task_id=task_id,
                item=item,
                seed=derive_seed(self.seed, "val", index),
                is_val=True,
            )
            for index, (item, task_id) in enumerate(self.task.val_items)
            for run_id in range(samples)
        ]
