"""Write the grade-school math items of this example: JSON lines and parquet, in verl's layout.

Every item is drawn from a template by a seeded generator, so running this again writes
the same items; no question appears twice, and none of the held-out ones in training. Each row has ``prompt`` (chat messages), ``reward_model.ground_truth``
(the answer: an integer, a price like ``7.50``, or a reduced fraction like ``3/4``), and ``id``, ``data_source``, ``ability``,
``extra_info`` as verl's data pipeline writes them.

    python make_data.py            # writes train.* and val.* beside this file
    python make_data.py OUT_DIR
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from fractions import Fraction
from pathlib import Path
from typing import Any

SEED = 2024
SPLITS = {"train": 320, "val": 80}
INSTRUCTION = "Think step by step, then put your final answer in \\boxed{}."
NAMES = ("Maya", "Liam", "Ava", "Noah", "Zoe", "Omar", "Ines", "Kai", "Lena", "Ravi")


def show(value: Fraction) -> str:
    """An answer as the dataset writes it: an integer, or a reduced fraction ``p/q``."""
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def dollars(value: Fraction) -> str:
    """A price as a shop writes it: ``7.50``, or ``12`` for whole dollars."""
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.2f}"


def shopping(rng: random.Random) -> tuple[str, str]:
    name, count, cents = rng.choice(NAMES), rng.randint(2, 9), rng.choice((25, 50, 75, 120, 150, 225, 310))
    question = f"{name} buys {count} notebooks that cost ${cents / 100:.2f} each. How many dollars does {name} spend?"
    return question, dollars(Fraction(count * cents, 100))


def pizza(rng: random.Random) -> tuple[str, str]:
    slices = rng.choice((6, 8, 10, 12))
    eaten = rng.randint(1, slices - 1)
    question = (
        f"A pizza is cut into {slices} equal slices and {rng.choice(NAMES)} eats {eaten} of them. What fraction of the pizza is left?"
    )
    return question, show(Fraction(slices - eaten, slices))


def train_trip(rng: random.Random) -> tuple[str, str]:
    speed, hours = rng.randint(4, 18) * 5, rng.randint(2, 6)
    return f"A train travels at {speed} km per hour for {hours} hours. How many kilometres does it travel?", str(speed * hours)


def marbles(rng: random.Random) -> tuple[str, str]:
    name, start, given, bought = rng.choice(NAMES), rng.randint(20, 90), rng.randint(1, 19), rng.randint(1, 30)
    question = f"{name} has {start} marbles, gives {given} to a friend and then buys {bought} more. How many marbles does {name} have now?"
    return question, str(start - given + bought)


def sale(rng: random.Random) -> tuple[str, str]:
    price, off = rng.randint(2, 15) * 20, rng.choice((10, 20, 25, 50))
    question = f"A jacket costs ${price}. It is on sale for {off}% off. What is the sale price in dollars?"
    return question, dollars(Fraction(price * (100 - off), 100))


def teams(rng: random.Random) -> tuple[str, str]:
    size = rng.randint(3, 7)
    students = size * rng.randint(3, 9) + rng.randint(0, size - 1)
    question = f"{students} students are split into teams of {size}. How many full teams can they make?"
    return question, str(students // size)


def minutes(rng: random.Random) -> tuple[str, str]:
    hours, extra = rng.randint(1, 5), rng.randint(1, 59)
    return f"How many minutes are there in {hours} hours and {extra} minutes?", str(hours * 60 + extra)


def garden(rng: random.Random) -> tuple[str, str]:
    width, length = rng.randint(3, 15), rng.randint(4, 25)
    question = f"A rectangular garden is {width} m wide and {length} m long. What is its area in square metres?"
    return question, str(width * length)


def average(rng: random.Random) -> tuple[str, str]:
    scores = [rng.randint(50, 100) for _ in range(3)]
    question = f"{rng.choice(NAMES)} scored {scores[0]}, {scores[1]} and {scores[2]} on three tests. What is the average score?"
    return question, show(Fraction(sum(scores), 3))


TEMPLATES: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "shopping": shopping,
    "pizza": pizza,
    "train_trip": train_trip,
    "marbles": marbles,
    "sale": sale,
    "teams": teams,
    "minutes": minutes,
    "garden": garden,
    "average": average,
}


def make_items(split: str, count: int, exclude: AbstractSet[str] = frozenset(), seed: int = SEED) -> list[dict[str, Any]]:
    """``count`` distinct items of ``split``, none asking a question in ``exclude``; the same
    every time for the same arguments."""
    rng = random.Random(f"{seed}:{split}")
    items: list[dict[str, Any]] = []
    seen = set(exclude)
    while len(items) < count:
        template = rng.choice(sorted(TEMPLATES))
        question, answer = TEMPLATES[template](rng)
        if question in seen:
            continue
        seen.add(question)
        index = len(items)
        items.append(
            {
                "id": f"{split}-{index:04d}",
                "data_source": "nexrl/grade_school_math",
                "prompt": [{"role": "user", "content": f"{question}\n{INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {"split": split, "index": index, "template": template},
            }
        )
    return items


def question_of(item: dict[str, Any]) -> str:
    return item["prompt"][0]["content"].removesuffix(f"\n{INSTRUCTION}")


def write(out_dir: Path) -> list[Path]:
    """Write ``<split>.jsonl`` and ``<split>.parquet`` for every split; returns the files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    val = make_items("val", SPLITS["val"])
    train = make_items("train", SPLITS["train"], exclude={question_of(item) for item in val})
    written = []
    for split, items in (("train", train), ("val", val)):
        jsonl = out_dir / f"{split}.jsonl"
        jsonl.write_text("".join(json.dumps(item) + "\n" for item in items), encoding="utf-8")
        parquet = out_dir / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(items), parquet)
        written += [jsonl, parquet]
    return written


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent
    for path in write(target):
        print(path)
