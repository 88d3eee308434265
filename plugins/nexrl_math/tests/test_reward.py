"""The math reward on known cases: where the answer is found, and which answers are equal."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from nexrl_math import answers_match, extract_answer, math_reward, parse_reference
from nexrl_math.reward import MAX_REPLY_CHARS


@pytest.mark.parametrize(
    ("reply", "written"),
    [
        ("The answer is \\boxed{\\frac{3}{4}}.", "\\frac{3}{4}"),
        ("First 3+4=7, then \\boxed{8}", "8"),  # \boxed wins over an earlier result
        ("The final answer is 7. Checking again: \\boxed{8}", "8"),  # ... and over "the final answer is"
        ("\\boxed{1/2} and later 7", "\\frac{1}{2}"),
        ("So she has \\boxed{12\\text{ apples}}.", "12"),  # units dropped
        ("The answer is: 6 boxes.", "6"),
        ("#### 42", "42"),
        ("It costs $3, then $4, total $7", "7"),  # the last value
        ("The total is $12.50.", "12.50"),
        ("\\boxed{1{,}000}", "1,000"),
        ("\\(\\dfrac{6}{8}\\)", "\\frac{6}{8}"),
    ],
)
def test_the_final_answer_is_found(reply: str, written: str) -> None:
    answer = extract_answer(reply)
    assert answer is not None and answer.text == written


@pytest.mark.parametrize("reply", ["", "I do not know.", "Let me think about the apples"])
def test_a_reply_without_an_answer_has_none_and_scores_zero(reply: str) -> None:
    assert extract_answer(reply) is None
    assert math_reward(reply, "7") == 0.0


@pytest.mark.parametrize(
    ("reply", "reference"),
    [
        ("\\boxed{\\frac{3}{4}}", "0.75"),  # fraction vs decimal
        ("The answer is 0.75", "3/4"),
        ("\\boxed{\\dfrac{6}{8}}", "3/4"),  # not reduced
        ("3/4 of the pizza is left", "\\frac{3}{4}"),
        ("\\boxed{1\\frac{1}{2}}", "3/2"),  # mixed number in LaTeX
        ("\\boxed{12\\text{ apples}}", "12"),  # units in LaTeX
        ("\\boxed{5 \\mathrm{km}}", 5),
        ("It travels 150 km.", "150"),  # units in plain text
        ("The sale price is \\boxed{\\$4.20}", "4.2"),  # currency, trailing zero
        ("The total is $7.50.", "7.50"),
        ("\\boxed{40\\%}", "0.4"),  # percent
        ("The answer is 1,000", 1000),  # thousands separator
        ("\\boxed{1{,}000}", "1000"),
        ("x = 5", 5),
        ("The average is \\boxed{\\frac{208}{3}}", "208/3"),
    ],
)
def test_equal_values_match_whatever_their_form(reply: str, reference: str | int) -> None:
    assert answers_match(reply, reference)
    assert math_reward(reply, reference) == 1.0


@pytest.mark.parametrize(
    ("reply", "reference"),
    [
        ("\\boxed{8}", "7"),
        ("First 3+4=7, then \\boxed{8}", "7"),  # the boxed answer is the answer
        ("\\boxed{\\frac{1}{2}} and 7", "7"),
        ("The answer is 0.333", "1/3"),  # a rounded value is not the value
        ("12 15", "12"),  # the last number is the answer
        ("\\boxed{3/5}", "3/4"),
    ],
)
def test_different_values_do_not_match(reply: str, reference: str) -> None:
    assert not answers_match(reply, reference)
    assert math_reward(reply, reference) == 0.0


@pytest.mark.parametrize("reference", ["", "?", "--"])
def test_an_unreadable_reference_is_a_data_error(reference: str) -> None:
    with pytest.raises(ValueError, match=f"cannot read the reference answer {reference!r}"):
        parse_reference(reference)
    with pytest.raises(ValueError):
        math_reward("\\boxed{3}", reference)


def test_rewards_work_on_worker_threads_where_agents_run() -> None:
    """math-verify's own timeout needs the main thread; off it the helper runs without one."""
    cases = [("\\boxed{\\frac{3}{4}}", "0.75", 1.0), ("\\boxed{8}", "7", 0.0)] * 8
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        rewards = list(pool.map(lambda case: math_reward(case[0], case[1]), cases))
    assert rewards == [expected for _, _, expected in cases]
    assert threading.current_thread() is threading.main_thread()


def test_only_the_end_of_a_long_reply_is_searched() -> None:
    """The bound that keeps parsing time in check where no timeout can run."""
    filler = " and so on" * (MAX_REPLY_CHARS // 5)
    assert extract_answer("\\boxed{3}" + filler) is None
    started = time.monotonic()
    assert math_reward("blah " * 200_000 + "\\boxed{3}", "3") == 1.0
    assert time.monotonic() - started < 5.0
