"""The penalties' values on every interpreter, torch or not.

``output_tokens_tensor`` returns a torch tensor, so its own tests
(test_penalty_tokens.py) need torch, which only the default interpreter's
environment has; the int reads it relies on differ between CPython 3.11 and
3.12.  ``_kernels.penalty_output_tokens._fill_output_tokens`` runs the same
compiled passes into a numpy array, so these run wherever the kernel is built
(py310 to py313, asan).
"""

import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

import fastbatch._kernels.penalty_output_tokens as kernel
from token_lists import penalty_rows, vllm_0_33_penalty_array


def _fill(rows, vocab_size):
    out = np.empty((len(rows), max(map(len, rows), default=0)), dtype=np.int64)
    assert kernel._fill_output_tokens(rows, vocab_size, out) is out
    return out


@given(rows=penalty_rows(), vocab_size=st.sampled_from([0, 1, 100, 151_936, 2**40]))
def test_matches_vllm(rows, vocab_size):
    note(repr(rows))
    np.testing.assert_array_equal(_fill(rows, vocab_size),
                                  vllm_0_33_penalty_array(rows, vocab_size))


@pytest.mark.parametrize("value", [0, 1, -1, -2, 2**30 - 1, 2**30, -(2**30), 2**62,
                                   2**63 - 1, -(2**63)])
def test_compact_and_multi_digit_ints(value):
    """Around CPython's one-digit (compact) limit, 2**30, both ways."""
    assert _fill([[value, 5]], 7).tolist() == [[7 if value == -1 else value, 5]]


@pytest.mark.parametrize(("rows", "exception"), [
    ([[1, 2.0]], TypeError), ([["3"]], TypeError), ([[2**63]], OverflowError),
    ([[1], None], TypeError)], ids=["float", "str", "too big", "None row"])
def test_bad_items(rows, exception):
    out = np.full((len(rows), max(len(row or ()) for row in rows)), 123, dtype=np.int64)
    with pytest.raises(exception, match="output_token_ids"):
        kernel._fill_output_tokens(rows, 10, out)


@pytest.mark.parametrize("out", [
    np.empty((2, 3), dtype=np.int32), np.empty((2, 2), dtype=np.int64),
    np.empty((3, 2), dtype=np.int64).T, np.empty(6, dtype=np.int64)],
    ids=["int32", "wrong shape", "not C-contiguous", "1-D"])
def test_bad_out(out):
    with pytest.raises(ValueError, match="out must be"):
        kernel._fill_output_tokens([[1, 2, 3], [4]], 10, out)


def test_read_only_out():
    out = np.empty((1, 1), dtype=np.int64)
    out.flags.writeable = False
    with pytest.raises((BufferError, ValueError)):
        kernel._fill_output_tokens([[1]], 10, out)
