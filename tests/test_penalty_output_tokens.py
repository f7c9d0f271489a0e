"""The penalties' output-token tensor: compiled == reference == vLLM 0.33; bad input; leaks.

Needs torch (not vLLM): the oracle is ``token_lists.vllm_0_33_penalty_array``,
vLLM's ``make_ndarray_with_pad`` and masking transcribed;
``test_vllm_differential.py`` repeats this against the real functions.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

import fastbatch
from batches import Token
from fastbatch import _reference
from leaks import assert_no_leak
from token_lists import penalty_rows, vllm_0_33_penalty_array

VOCAB_SIZES = st.sampled_from([0, 1, 100, 151_936, 2**40])


def _check(tensor, rows, vocab_size):
    expected = vllm_0_33_penalty_array(rows, vocab_size)
    assert isinstance(tensor, torch.Tensor)
    assert tensor.dtype == torch.int64 and tensor.device.type == "cpu"
    assert tuple(tensor.shape) == expected.shape
    assert tensor.is_contiguous() and not tensor.is_pinned()
    np.testing.assert_array_equal(tensor.numpy(), expected)


@given(rows=penalty_rows(), vocab_size=VOCAB_SIZES)
def test_matches_vllm(implementation, rows, vocab_size):
    note(repr(rows))
    before = repr(rows)
    _check(implementation.output_tokens_tensor(rows, vocab_size), rows, vocab_size)
    assert repr(rows) == before  # the lists are only read


@given(rows=penalty_rows(), vocab_size=VOCAB_SIZES)
def test_compiled_and_reference_agree_on_results_and_stats(rows, vocab_size):
    results, stats = [], []
    for module in (fastbatch._kernels, _reference):
        module.reset_stats()
        results.append(module.output_tokens_tensor(rows, vocab_size))
        stats.append(module.stats())
    assert torch.equal(results[0], results[1])
    assert stats[0] == stats[1]
    assert stats[0]["penalty_tensors"] == 1
    assert stats[0]["penalty_tokens"] == sum(map(len, rows))


def test_worked_example(implementation):
    rows = [[5, -1, 7], [], [-1, -1], [99, 0, 3, 2, 1]]
    assert implementation.output_tokens_tensor(rows, 100).tolist() == [
        [5, 100, 7, 100, 100], [100] * 5, [100] * 5, [99, 0, 3, 2, 1]]


@pytest.mark.parametrize("rows", [[], [[]], [[], []]], ids=["no rows", "one empty",
                                                            "two empty"])
def test_empty_shapes(implementation, rows):
    tensor = implementation.output_tokens_tensor(rows, 10)
    assert tuple(tensor.shape) == (len(rows), 0) and tensor.dtype == torch.int64


def test_long_rows(implementation):
    rows = [list(range(i, i + 5000)) + [-1] * i for i in range(0, 40, 7)]
    _check(implementation.output_tokens_tensor(rows, 151_936), rows, 151_936)


def test_pin_memory_is_passed_to_torch(implementation):
    """Pinning needs an accelerator: without one, the request reaches torch
    and fails there, as stock's ``tensor.pin_memory()`` does."""
    if torch.cuda.is_available():
        assert implementation.output_tokens_tensor([[1, -1]], 5, True).is_pinned()
        return
    assert not implementation.output_tokens_tensor([[1, -1]], 5, False).is_pinned()
    with pytest.raises(RuntimeError):
        implementation.output_tokens_tensor([[1, -1]], 5, True)


# --- bad input: a clear exception ---------------------------------------------

@pytest.mark.parametrize(
    ("rows", "vocab_size", "exception", "message"),
    [
        ([[1, 2.0]], 10, TypeError, r"output_token_ids\[0\]\[1\] must be an int, got float"),
        ([[1], ["3"]], 10, TypeError, r"output_token_ids\[1\]\[0\] must be an int, got str"),
        ([[None]], 10, TypeError, "got NoneType"),
        ([[1], [2**63]], 10, OverflowError, r"output_token_ids\[1\]\[0\] = .* int64"),
        ([[-(2**63) - 1]], 10, OverflowError, "int64"),
        ([[1], None], 10, TypeError, r"output_token_ids\[1\] must be a list"),
        ([[1], np.array([1])], 10, TypeError, r"output_token_ids\[1\] must be a list"),
        ([[1]], 10.0, TypeError, "vocab_size"),
        ([[1]], "10", TypeError, "vocab_size"),
        ([[1]], 2**64, TypeError, "vocab_size"),
        ([[1]], -1, ValueError, "vocab_size"),
        (((1,),), 10, TypeError, "output_token_ids"),
    ],
    ids=["float", "str", "None item", "too big", "too small", "None row", "array row",
         "float vocab", "str vocab", "huge vocab", "negative vocab", "tuple of rows"],
)
def test_bad_input(implementation, rows, vocab_size, exception, message):
    """Stricter than numpy, which would truncate 2.0 and parse "3" silently."""
    with pytest.raises(exception, match=message):
        implementation.output_tokens_tensor(rows, vocab_size)


def test_index_like_items_are_accepted(implementation):
    rows = [[True, Token(-1), np.int64(4), np.int32(-1), Token(2**40)]]
    assert implementation.output_tokens_tensor(rows, 9).tolist() == [[1, 9, 4, 9, 2**40]]


def test_list_changed_by_index_is_caught_by_compiled():
    """An ``__index__`` that shortens the row: an error, not a read past its end."""
    row = [1, 2, 3]

    class Shrinking:
        def __index__(self):
            del row[1:]
            return 5

    row.insert(1, Shrinking())
    with pytest.raises(RuntimeError, match="changed"):
        fastbatch._kernels.output_tokens_tensor([row], 10)


# --- references and memory ---------------------------------------------------

def test_no_leak_on_success_or_error():
    kernel = fastbatch._kernels
    rows = [[300_000 + i, i, -1] * 50 for i in range(64)]
    bad_rows = [*rows, [1.5]]

    def step():
        kernel.output_tokens_tensor(rows, 151_936)
        with pytest.raises(TypeError):
            kernel.output_tokens_tensor(bad_rows, 151_936)

    for _ in range(100):
        step()
    assert_no_leak(step, [rows, bad_rows, *rows, rows[0][0]], 1000)
