"""Checkpoint paths and names as every protocol writes them (`nexrl_service.checkpoint_paths`)."""

from __future__ import annotations

import re

import pytest

from nexrl_service.checkpoint_paths import CheckpointPath, CheckpointPathFormat, check_checkpoint_name
from nexrl_service.errors import BadRequest

PATHS = CheckpointPathFormat("demo://", {"state": "training", "sampler": "sampler"}, example="demo://<model>/state/<name>")


def test_a_path_is_built_and_split_back() -> None:
    path = PATHS.path("m1", "sampler", "step-3")
    assert path == "demo://m1/sampler/step-3"
    assert PATHS.parse(path) == CheckpointPath(path, "m1", "sampler", "step-3", "sampler")
    assert PATHS.parse(path).below_model == "sampler/step-3"


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("other://m1/state/x", "it must start with 'demo://'"),
        (7, "it must start with 'demo://'"),
        ("demo://m1/state", "expected demo://<model>/state/<name>"),
        ("demo://m1//x", "expected demo://<model>/state/<name>"),
        ("demo://m1/weights/x", "the middle segment must be one of ['sampler', 'state']"),
    ],
)
def test_a_bad_path_is_refused_saying_what_is_wrong(path: object, says: str) -> None:
    with pytest.raises(BadRequest, match=f"invalid checkpoint path .*: {re.escape(says)}"):
        PATHS.parse(path)


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "a\\b", "tab\there", "x" * 201, 3])
def test_a_name_that_cannot_be_one_segment_is_refused(name: object) -> None:
    with pytest.raises(BadRequest, match="invalid checkpoint name"):
        check_checkpoint_name(name)


def test_a_plain_name_passes() -> None:
    assert check_checkpoint_name("step-0003.final") == "step-0003.final"
