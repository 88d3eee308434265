"""`split_microbatches`: consecutive passes within a padded-token budget and a row limit.

Checked against the limits themselves on random lengths, not against a second copy of
the packing: every pass respects both limits, passes keep the datums' order, and a pass
ends only where adding the next datum would break a limit (so no pass could take more).
"""

from __future__ import annotations

import random

import pytest

from nexrl_engine.loss_fns import CheckedDatum, split_microbatches


def _datums(lengths: list[int]) -> list[CheckedDatum]:
    return [CheckedDatum([1] * length, {"target_tokens": [1] * length}) for length in lengths]


def _padded(lengths: list[int]) -> int:
    return len(lengths) * max(lengths)


@pytest.mark.parametrize(("max_tokens", "max_rows"), [(40, None), (None, 3), (40, 3), (5, 2)])
def test_passes_keep_both_limits_and_end_only_where_the_next_datum_breaks_one(max_tokens: int | None, max_rows: int | None) -> None:
    rng = random.Random(3)
    for _ in range(50):
        lengths = [rng.randrange(1, 16) for _ in range(rng.randrange(1, 30))]
        groups = split_microbatches(_datums(lengths), max_tokens, max_rows)
        assert [index for group in groups for index in group] == list(range(len(lengths)))
        for number, group in enumerate(groups):
            sizes = [lengths[index] for index in group]
            if len(group) > 1:  # one datum alone may exceed the budget: it still gets its pass
                assert max_tokens is None or _padded(sizes) <= max_tokens
                assert max_rows is None or len(group) <= max_rows
            if number + 1 < len(groups):
                grown = sizes + [lengths[groups[number + 1][0]]]
                assert (max_tokens is not None and _padded(grown) > max_tokens) or (max_rows is not None and len(grown) > max_rows)


def test_without_limits_everything_is_one_pass() -> None:
    assert split_microbatches(_datums([3, 9, 1, 4]), None, None) == [[0, 1, 2, 3]]
