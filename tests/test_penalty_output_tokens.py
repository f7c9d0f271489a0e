"""penalty_output_tokens: ``penalties._convert_to_tensors`` and, after it,
``apply_all_penalties`` without its masking.

* ``output_tokens_tensor``: compiled kernel == pure-Python twin == vLLM 0.33
  (the oracle is ``token_lists.vllm_0_33_penalty_array``, vLLM's
  ``make_ndarray_with_pad`` and masking transcribed); bad input; leaks.  It
  returns a torch tensor: these tests take the ``torch`` fixture, and are
  skipped where torch is not installed (the other interpreters' environments);
* the compiled passes into a numpy array (``_fill_output_tokens``), on every
  interpreter, torch or not: the int reads they rely on differ between
  CPython 3.11 and 3.12;
* against the REAL vLLM 0.33.0 functions (``vllm``-marked): the tensor against
  ``_convert_to_tensors``, and the penalised logits of ``apply_all_penalties``,
  stock and with the piece applied (the masking skipped exactly after
  fastbatch's own conversion).

Neither vLLM nor torch is imported at module level.
"""

import contextlib
import functools
import os

import numpy as np
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

import fastbatch
import fastbatch._kernels.penalty_output_tokens as kernel
from batches import VLLM_MAX_REQS, Token
from fastbatch import _reference, registry
from fastbatch.patches import penalty_output_tokens as patch
from leaks import assert_no_leak
from token_lists import penalty_rows, vllm_0_33_penalty_array

NAME = "penalty_output_tokens"
PIECE = registry.piece(NAME)
VOCAB_SIZES = st.sampled_from([0, 1, 100, 151_936, 2**40])
EXAMPLES = int(os.environ.get("FASTBATCH_VLLM_EXAMPLES", 1000))


@pytest.fixture(scope="module")
def torch():
    """torch, for the tests of the tensor (skipped where it is not installed)."""
    return pytest.importorskip("torch")


# --- the tensor: compiled == reference == vLLM 0.33 (transcribed) -------------

def _check(tensor, rows, vocab_size):
    import torch

    expected = vllm_0_33_penalty_array(rows, vocab_size)
    assert isinstance(tensor, torch.Tensor)
    assert tensor.dtype == torch.int64 and tensor.device.type == "cpu"
    assert tuple(tensor.shape) == expected.shape
    assert tensor.is_contiguous() and not tensor.is_pinned()
    np.testing.assert_array_equal(tensor.numpy(), expected)


@given(rows=penalty_rows(), vocab_size=VOCAB_SIZES)
def test_matches_vllm(torch, implementation, rows, vocab_size):
    note(repr(rows))
    before = repr(rows)
    _check(implementation.output_tokens_tensor(rows, vocab_size), rows, vocab_size)
    assert repr(rows) == before  # the lists are only read


@given(rows=penalty_rows(), vocab_size=VOCAB_SIZES)
def test_compiled_and_reference_agree_on_results_and_stats(torch, rows, vocab_size):
    results, stats = [], []
    for module in (fastbatch._kernels, _reference):
        module.reset_stats()
        results.append(module.output_tokens_tensor(rows, vocab_size))
        stats.append(module.stats())
    assert torch.equal(results[0], results[1])
    assert stats[0] == stats[1]
    assert stats[0][NAME]["tensors"] == 1
    assert stats[0][NAME]["tokens"] == sum(map(len, rows))


def test_worked_example(torch, implementation):
    rows = [[5, -1, 7], [], [-1, -1], [99, 0, 3, 2, 1]]
    assert implementation.output_tokens_tensor(rows, 100).tolist() == [
        [5, 100, 7, 100, 100], [100] * 5, [100] * 5, [99, 0, 3, 2, 1]]


@pytest.mark.parametrize("rows", [[], [[]], [[], []]], ids=["no rows", "one empty",
                                                            "two empty"])
def test_empty_shapes(torch, implementation, rows):
    tensor = implementation.output_tokens_tensor(rows, 10)
    assert tuple(tensor.shape) == (len(rows), 0) and tensor.dtype == torch.int64


def test_long_rows(torch, implementation):
    rows = [list(range(i, i + 5000)) + [-1] * i for i in range(0, 40, 7)]
    _check(implementation.output_tokens_tensor(rows, 151_936), rows, 151_936)


def test_pin_memory_is_passed_to_torch(torch, implementation):
    """Pinning needs an accelerator: without one, the request reaches torch
    and fails there, as stock's ``tensor.pin_memory()`` does."""
    if torch.cuda.is_available():
        assert implementation.output_tokens_tensor([[1, -1]], 5, True).is_pinned()
        return
    assert not implementation.output_tokens_tensor([[1, -1]], 5, False).is_pinned()
    with pytest.raises(RuntimeError):
        implementation.output_tokens_tensor([[1, -1]], 5, True)


# --- the tensor's bad input: a clear exception -----------------------------------

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
def test_bad_input(torch, implementation, rows, vocab_size, exception, message):
    """Stricter than numpy, which would truncate 2.0 and parse "3" silently."""
    with pytest.raises(exception, match=message):
        implementation.output_tokens_tensor(rows, vocab_size)


def test_index_like_items_are_accepted(torch, implementation):
    rows = [[True, Token(-1), np.int64(4), np.int32(-1), Token(2**40)]]
    assert implementation.output_tokens_tensor(rows, 9).tolist() == [[1, 9, 4, 9, 2**40]]


def test_list_changed_by_index_is_caught_by_compiled(torch):
    """An ``__index__`` that shortens the row: an error, not a read past its end."""
    row = [1, 2, 3]

    class Shrinking:
        def __index__(self):
            del row[1:]
            return 5

    row.insert(1, Shrinking())
    with pytest.raises(RuntimeError, match="changed"):
        fastbatch._kernels.output_tokens_tensor([row], 10)


# --- the tensor: references and memory --------------------------------------------

def test_no_leak_on_success_or_error(torch):
    rows = [[300_000 + i, i, -1] * 50 for i in range(64)]
    bad_rows = [*rows, [1.5]]

    def step():
        kernel.output_tokens_tensor(rows, 151_936)
        with pytest.raises(TypeError):
            kernel.output_tokens_tensor(bad_rows, 151_936)

    for _ in range(100):
        step()
    assert_no_leak(step, [rows, bad_rows, *rows, rows[0][0]], 1000)


# --- the compiled passes into numpy, on every interpreter (no torch) -----------

def _fill(rows, vocab_size):
    out = np.empty((len(rows), max(map(len, rows), default=0)), dtype=np.int64)
    assert kernel._fill_output_tokens(rows, vocab_size, out) is out
    return out


@given(rows=penalty_rows(), vocab_size=VOCAB_SIZES)
def test_fill_matches_vllm(rows, vocab_size):
    note(repr(rows))
    np.testing.assert_array_equal(_fill(rows, vocab_size),
                                  vllm_0_33_penalty_array(rows, vocab_size))


@pytest.mark.parametrize("value", [0, 1, -1, -2, 2**30 - 1, 2**30, -(2**30), 2**62,
                                   2**63 - 1, -(2**63)])
def test_fill_compact_and_multi_digit_ints(value):
    """Around CPython's one-digit (compact) limit, 2**30, both ways."""
    assert _fill([[value, 5]], 7).tolist() == [[7 if value == -1 else value, 5]]


@pytest.mark.parametrize(("rows", "exception"), [
    ([[1, 2.0]], TypeError), ([["3"]], TypeError), ([[2**63]], OverflowError),
    ([[1], None], TypeError)], ids=["float", "str", "too big", "None row"])
def test_fill_bad_items(rows, exception):
    out = np.full((len(rows), max(len(row or ()) for row in rows)), 123, dtype=np.int64)
    with pytest.raises(exception, match="output_token_ids"):
        kernel._fill_output_tokens(rows, 10, out)


@pytest.mark.parametrize("out", [
    np.empty((2, 3), dtype=np.int32), np.empty((2, 2), dtype=np.int64),
    np.empty((3, 2), dtype=np.int64).T, np.empty(6, dtype=np.int64)],
    ids=["int32", "wrong shape", "not C-contiguous", "1-D"])
def test_fill_bad_out(out):
    with pytest.raises(ValueError, match="out must be"):
        kernel._fill_output_tokens([[1, 2, 3], [4]], 10, out)


def test_fill_read_only_out():
    out = np.empty((1, 1), dtype=np.int64)
    out.flags.writeable = False
    with pytest.raises((BufferError, ValueError)):
        kernel._fill_output_tokens([[1]], 10, out)


# --- against the real vLLM 0.33.0: _convert_to_tensors and apply_all_penalties ---

VOCAB = 64
PENALISED_ROWS = st.lists(st.lists(st.one_of(st.integers(0, VOCAB - 1), st.just(-1)),
                                   max_size=30), max_size=VLLM_MAX_REQS)


def _bindings():
    """The names apply_all_penalties has: penalties.py's, and the two modules
    that import it by name."""
    from vllm.v1.sample import rejection_sampler, sampler
    from vllm.v1.sample.ops import penalties

    return penalties, sampler, rejection_sampler


@functools.cache
def _stock_apply_all():
    """vLLM's own ``apply_all_penalties`` (penalties.py's binding)."""
    from vllm.v1.sample.ops import penalties

    function = patch.MASKING_PATCHES[-1].original() or penalties.apply_all_penalties
    assert patch.MASKING_PATCHES[-1].module == penalties.__name__
    assert not getattr(function, "__fastbatch__", False)
    return function


@pytest.fixture(scope="module")
def unpinned():
    """vLLM 0.33.0's GPU wheel on a machine without a GPU still says
    PIN_MEMORY=True, and stock's ``tensor.pin_memory()`` then fails; pinning
    is checked in test_plugin.py, the values here."""
    from vllm.v1.sample.ops import penalties

    saved, penalties.PIN_MEMORY = penalties.PIN_MEMORY, False
    yield
    penalties.PIN_MEMORY = saved


@pytest.mark.vllm
@settings(max_examples=EXAMPLES)
@given(rows=penalty_rows(), vocab_size=st.sampled_from([1, 64, 151_936]))
def test_penalty_tensor_matches_real_convert_to_tensors(unpinned, implementation, rows,
                                                        vocab_size):
    import torch
    from vllm.v1.sample.ops import penalties

    note(repr(rows))
    original = patch.PATCH.original() or penalties._convert_to_tensors
    expected = original(rows, vocab_size, torch.device("cpu"))
    expected.masked_fill_(expected == -1, vocab_size)  # as apply_all_penalties does
    got = implementation.output_tokens_tensor(rows, vocab_size)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(got, expected)
    np.testing.assert_array_equal(got.numpy(), vllm_0_33_penalty_array(rows, vocab_size))


@pytest.mark.vllm
@settings(max_examples=EXAMPLES // 4)
@given(rows=PENALISED_ROWS, seed=st.integers(0, 2**16))
def test_apply_all_penalties_gives_the_same_logits_patched(unpinned, rows, seed):
    """The whole of vLLM's penalties, stock and with the patch installed."""
    import torch
    from vllm.v1.sample.ops import penalties

    generator = torch.Generator().manual_seed(seed)
    num_reqs = len(rows)
    logits = torch.randn((num_reqs, VOCAB), generator=generator)
    prompt = torch.randint(0, VOCAB + 1, (num_reqs, 7), generator=generator)
    presence = torch.rand(num_reqs, generator=generator)
    frequency = torch.rand(num_reqs, generator=generator)
    repetition = 1 + torch.rand(num_reqs, generator=generator)

    def penalised(binding):
        return binding.apply_all_penalties(logits.clone(), prompt, presence, frequency,
                                           repetition, rows)

    stock = penalised(penalties)
    assert PIECE.apply()
    try:
        assert all(patch.masking_skipped().values())
        for binding in _bindings():  # each caller's own name for the function
            assert binding.apply_all_penalties is patch.apply_all_penalties
            fastbatch.reset_stats()
            assert torch.equal(penalised(binding), stock)
            assert fastbatch.stats()[NAME]["tensors"] == 1
    finally:
        PIECE.revert()
    assert not any(patch.masking_skipped().values())
    assert all(binding.apply_all_penalties is _stock_apply_all() for binding in _bindings())


def _penalty_inputs(rows, seed):
    import torch

    generator = torch.Generator().manual_seed(seed)
    num_reqs = len(rows)
    logits = torch.randn((num_reqs, VOCAB), generator=generator)
    prompt = torch.randint(0, VOCAB + 1, (num_reqs, 7), generator=generator)
    penalty_values = (torch.rand(num_reqs, generator=generator),
                      torch.rand(num_reqs, generator=generator),
                      1 + torch.rand(num_reqs, generator=generator))
    return logits, prompt, penalty_values


@contextlib.contextmanager
def masked_fill_calls():
    """The shapes ``Tensor.masked_fill_`` ran on, in the block (apply_penalties
    itself never calls it: only apply_all_penalties' masking does)."""
    import torch

    calls = []
    real = torch.Tensor.masked_fill_

    def counted(self, *args, **kwargs):
        calls.append(tuple(self.shape))
        return real(self, *args, **kwargs)

    torch.Tensor.masked_fill_ = counted
    try:
        yield calls
    finally:
        torch.Tensor.masked_fill_ = real


def _wrapped(function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):  # a profiler's timer, say
        return function(*args, **kwargs)
    return wrapper


@pytest.mark.vllm
@settings(max_examples=EXAMPLES // 4)
@given(rows=PENALISED_ROWS, seed=st.integers(0, 2**16),
       conversion=st.sampled_from(["fastbatch", "stock", "wrapped fastbatch"]))
def test_no_masking_only_after_fastbatchs_conversion(unpinned, rows, seed, conversion):
    """fastbatch's apply_all_penalties skips the masking exactly when the
    conversion it called is fastbatch's; after stock's conversion (the piece
    reverted, or its function wrapped) it masks as vLLM does, so the
    penalised logits are vLLM's with and without -1 in the rows."""
    import torch
    from vllm.v1.sample.ops import penalties

    logits, prompt, penalty_values = _penalty_inputs(rows, seed)
    stock = _stock_apply_all()(logits.clone(), prompt, *penalty_values, rows)
    installed = {"fastbatch": patch._convert_to_tensors,
                 "stock": patch.PATCH.original() or penalties._convert_to_tensors,
                 "wrapped fastbatch": _wrapped(patch._convert_to_tensors)}
    saved, penalties._convert_to_tensors = penalties._convert_to_tensors, installed[conversion]
    try:
        with masked_fill_calls() as masked:
            got = patch.apply_all_penalties(logits.clone(), prompt, *penalty_values, rows)
    finally:
        penalties._convert_to_tensors = saved
    assert torch.equal(got, stock)
    assert len(masked) == (conversion != "fastbatch")


@pytest.mark.vllm
def test_no_masking_with_the_piece_applied(unpinned):
    import torch

    rows = [[5, -1, 7], [], [-1, -1], [3, 2, 1]]
    logits, prompt, penalty_values = _penalty_inputs(rows, 0)
    with masked_fill_calls() as masked:
        stock = _stock_apply_all()(logits.clone(), prompt, *penalty_values, rows)
    assert masked == [(4, 3)]
    assert PIECE.apply()
    try:
        for binding in _bindings():
            with masked_fill_calls() as masked:
                got = binding.apply_all_penalties(logits.clone(), prompt, *penalty_values,
                                                  rows)
            assert torch.equal(got, stock) and masked == []
    finally:
        PIECE.revert()
