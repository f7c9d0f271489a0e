"""The previous-row column: compiled == reference == vLLM 0.33's loop; bad input; leaks.

No vLLM needed: the oracle is ``vllm_loop``, the loop of vLLM's
``GPUModelRunner._compute_prev_positions`` transcribed;
``test_vllm_prev_positions.py`` repeats this on the real method.
"""

import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

import fastbatch
from fastbatch import _reference
from leaks import assert_no_leak

NAMES = [f"r{i}" for i in range(12)]


def vllm_loop(req_ids, prev_req_id_to_index, prev_positions_np, num_reqs):
    """vLLM 0.21.0-0.33.0's loop (after its early return for an empty map)."""
    prev_positions = prev_positions_np[:num_reqs]
    for i, req_id in enumerate(req_ids[:num_reqs]):
        prev_positions[i] = prev_req_id_to_index.get(req_id, -1)


@st.composite
def columns(draw):
    """(req_ids, map, column, num_reqs): kept, moved, new and finished
    requests, holes, duplicates, fewer or more requests than num_reqs, a
    strided column."""
    req_ids = draw(st.lists(st.sampled_from([*NAMES, None]), max_size=10))
    prev = draw(st.dictionaries(st.sampled_from(NAMES), st.one_of(
        st.integers(0, 16), st.integers(-2**63, 2**63 - 1), st.just(-1)), max_size=12))
    num_reqs = draw(st.integers(0, len(req_ids) + 2))
    slots = min(num_reqs, len(req_ids)) + draw(st.integers(0, 3))
    stride = draw(st.sampled_from([1, 2]))
    column = np.arange(100, 100 + slots * stride, dtype=np.int64)[::stride]
    return req_ids, prev, column, num_reqs


@given(case=columns())
def test_matches_vllm_loop(implementation, case):
    note(repr(case))
    req_ids, prev, column, num_reqs = case
    expected = column.copy()
    vllm_loop(req_ids, prev, expected, num_reqs)
    found = implementation.compute_prev_positions(req_ids, prev, column, num_reqs)
    assert column.tolist() == expected.tolist()
    assert found == sum(1 for req_id in req_ids[:num_reqs] if req_id in prev)


@given(case=columns())
def test_compiled_and_reference_agree_on_results_and_stats(case):
    results, stats = [], []
    for module in (fastbatch._kernels, _reference):
        module.reset_stats()
        req_ids, prev, column, num_reqs = case
        column = column.copy()
        results.append((module.compute_prev_positions(req_ids, prev, column, num_reqs),
                        column.tolist()))
        stats.append({key: value for key, value in module.stats().items()
                      if key.startswith("prev_positions")})
    assert results[0] == results[1]
    assert stats[0] == stats[1] == {"prev_positions_calls": 1,
                                    "prev_positions_found": results[0][0]}


def test_worked_example(implementation):
    column = np.full(6, 7, dtype=np.int64)
    found = implementation.compute_prev_positions(
        ["kept", "moved", "new", None, "last"], {"kept": 0, "moved": 3, "gone": 1,
                                                 "last": 2}, column[:4], 4)
    assert found == 2
    assert column.tolist() == [0, 3, -1, -1, 7, 7]  # only num_reqs entries written


def test_values_numpy_accepts_are_accepted(implementation):
    """vLLM stores Python ints; bools and numpy ints store as numpy stores them."""
    column = np.zeros(3, dtype=np.int64)
    implementation.compute_prev_positions(
        ["a", "b", "c"], {"a": True, "b": np.int32(5), "c": 2**63 - 1}, column, 3)
    assert column.tolist() == [1, 5, 2**63 - 1]


# --- bad input: a clear exception, and nothing changed ----------------------

def _bad_cases():
    """(name, args, exception, message) for each kind of bad input."""
    good_ids, good_map = ["a", "b", "c"], {"a": 2, "b": 0}

    def column(dtype=np.int64, size=3):
        return np.full(size, 7, dtype=dtype)

    read_only = column()
    read_only.flags.writeable = False
    return [
        ("req_ids not a list", (tuple(good_ids), good_map, column(), 3), TypeError, "req_ids"),
        ("map not a dict", (good_ids, [("a", 2)], column(), 3), TypeError,
         "prev_req_id_to_index"),
        ("column int32", (good_ids, good_map, column(np.int32), 3), TypeError, "int64"),
        ("column float", (good_ids, good_map, column(np.float64), 3), TypeError, "int64"),
        ("column 2-D", (good_ids, good_map, np.zeros((3, 1), np.int64), 3), TypeError,
         "1-D"),
        ("column a list", (good_ids, good_map, [7, 7, 7], 3), TypeError, "prev_positions"),
        ("column read-only", (good_ids, good_map, read_only, 3), TypeError, "writable"),
        ("too few slots", (good_ids, good_map, column(size=2), 3), IndexError, "slots"),
        ("negative num_reqs", (good_ids, good_map, column(), -1), ValueError, "num_reqs"),
        ("value a string", (good_ids, {"a": "2"}, column(), 3), TypeError, "'a'"),
        ("value a float", (good_ids, {"b": 1.0}, column(), 3), TypeError, "'b'"),
        ("value None", (good_ids, {"c": None}, column(), 3), TypeError, "'c'"),
        ("value too big", (good_ids, {"c": 2**63}, column(), 3), OverflowError, "int64"),
        ("value too small", (good_ids, {"c": -2**63 - 1}, column(), 3), OverflowError,
         "int64"),
        ("unhashable id", (["a", ["b"]], good_map, column(), 3), TypeError, "unhashable"),
    ]


@pytest.mark.parametrize(("name", "args", "exception", "message"), _bad_cases(),
                         ids=[case[0] for case in _bad_cases()])
def test_bad_input_raises_before_any_change(implementation, name, args, exception,
                                            message):
    column = args[2]
    before = np.array(column).tolist()
    with pytest.raises(exception, match=message):
        implementation.compute_prev_positions(*args)
    assert np.array(column).tolist() == before


def test_vllm_would_write_part_of_the_column_before_failing():
    """Where vLLM's loop fails half way (a bad value after good ones), it has
    already written the good ones; fastbatch writes nothing (stricter)."""
    column, ours = np.full(3, 7, dtype=np.int64), np.full(3, 7, dtype=np.int64)
    with pytest.raises(TypeError):
        vllm_loop(["a", "b"], {"a": 1, "b": None}, column, 2)
    with pytest.raises(TypeError):
        fastbatch.compute_prev_positions(["a", "b"], {"a": 1, "b": None}, ours, 2)
    assert column.tolist() == [1, 7, 7] and ours.tolist() == [7, 7, 7]


# --- references and memory ---------------------------------------------------

def test_no_leak_on_success_or_error():
    kernel = fastbatch._kernels
    req_ids = [f"r{i}" for i in range(64)] + [None]
    prev = {req_id: 300_000 + i for i, req_id in enumerate(req_ids[:60])}
    bad_prev = {**prev, "r9": 1.5}
    column = np.zeros(80, dtype=np.int64)

    def step():
        kernel.compute_prev_positions(req_ids, prev, column, 65)
        with pytest.raises(TypeError):
            kernel.compute_prev_positions(req_ids, bad_prev, column, 65)
        with pytest.raises(IndexError):
            kernel.compute_prev_positions(req_ids, prev, column[:3], 65)

    for _ in range(100):
        step()
    assert_no_leak(step, [req_ids, prev, bad_prev, column, *req_ids[:64]], 2000)
    assert column[:3].tolist() == [300_000, 300_001, 300_002]
