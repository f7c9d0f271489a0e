"""``fastbatch.patches._compare``: the comparison the shadows, the lockstep
harness and the activation checks share (no vLLM needed)."""

import dataclasses
from array import array

import numpy as np

from fastbatch.patches._compare import equal, first_difference, plain


@dataclasses.dataclass
class Point:
    x: int
    y: list[int]


def test_equal_values_have_no_difference():
    value = {"a": [1, 2, (3, "x")], 4: Point(1, [2])}
    assert first_difference(value, {"a": [1, 2, (3, "x")], 4: Point(1, [2])}) is None


def test_the_first_difference_is_found_and_named():
    assert first_difference({"a": [1, 2]}, {"a": [1, 3]}) == ".a[1]: fastbatch 2, vLLM 3"
    assert first_difference({"a": 1}, {"b": 1}) == ".a: only in fastbatch's"
    assert first_difference({1: "x"}, {1: "y"}) == "[1]: fastbatch 'x', vLLM 'y'"
    assert first_difference([1, 2], [1, 2, 3], "rows") == (
        "rows: 2 items in fastbatch's, 3 in vLLM's")
    assert first_difference((("r1", 1), ("r2", 2)), (("r1", 1), ("r2", 5)), "m") == (
        "m['r2']: fastbatch 2, vLLM 5")  # a mapping as pairs, by key


def test_types_count():
    assert not equal(1, True) and not equal([1], (1,))
    assert first_difference(1, True) == "outcome: fastbatch 1, vLLM True"
    assert first_difference([[1]], [(1,)]) == "[0]: fastbatch [1], vLLM (1,)"


def test_nan_differs_from_another_nan():
    assert first_difference([float("nan")], [float("nan")]) == "[0]: fastbatch nan, vLLM nan"


def test_arrays_compare_exactly():
    ours, stock = np.arange(4, dtype=np.int32), np.arange(4, dtype=np.int64)
    assert plain(ours) != plain(stock)  # the dtype counts
    assert first_difference({"x": ours}, {"x": ours.copy()}) is None
    assert first_difference({"x": ours}, {"x": ours[::-1].copy()}) is not None
    assert plain(array("i", [1, 2])) == ("array", "i", [1, 2])
