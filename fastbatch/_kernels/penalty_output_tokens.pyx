# Compiler directives are set in setup.py (one place, with a debug switch).
"""Compiled piece ``penalty_output_tokens``: the padded output-token tensor of vLLM's penalties.

``vllm/v1/sample/ops/penalties.py``: ``_convert_to_tensors`` followed by
``apply_all_penalties``' ``-1 -> vocab_size`` masking, written straight into
one new int64 tensor.  ``fastbatch._reference`` holds the same behaviour in
plain Python.
"""

__all__ = ["output_tokens_tensor"]

from cpython.buffer cimport (
    PyBUF_RECORDS,
    PyBuffer_IsContiguous,
    PyBuffer_Release,
    PyObject_GetBuffer,
)
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.object cimport PyObject
from libc.stdint cimport int64_t, uint64_t, uintptr_t

from fastbatch._kernels._common cimport (
    PyList_Check,
    PyLong_Check,
    PyLong_CheckExact,
    PySequence_Fast_ITEMS,
    PyTuple_Check,
    Py_SIZE,
    long_as_compact,
)

# Process-wide counters, read with stats().
cdef uint64_t _penalty_tensors = 0
cdef uint64_t _penalty_tokens = 0


def stats():
    """This piece's counters since import or the last ``reset_stats()``."""
    return {"tensors": _penalty_tensors, "tokens": _penalty_tokens}


def reset_stats():
    """Set every counter of ``stats()`` back to zero."""
    global _penalty_tensors, _penalty_tokens
    _penalty_tensors = _penalty_tokens = 0


cdef object _torch_empty = None  # torch.empty and torch.int64, imported on
cdef object _torch_int64 = None  # the first call (vLLM has imported torch)


cdef int64_t _token_value_slow(PyObject* item, Py_ssize_t row,
                               Py_ssize_t position) except? -1:
    """A token id that is not a compact int: an int subclass, a big int or an
    ``__index__`` object (a numpy int, say).  Floats and strings, which numpy
    would silently truncate or parse, are refused."""
    cdef object value
    if PyLong_Check(item):
        value = <object>item
    else:
        try:
            value = (<object>item).__index__()
        except AttributeError:
            raise TypeError(
                f"output_token_ids[{row}][{position}] must be an int, "
                f"got {type(<object>item).__name__}"
            ) from None
    try:
        return <int64_t>int(value)
    except OverflowError:
        raise OverflowError(
            f"output_token_ids[{row}][{position}] = {value} does not fit in int64"
        ) from None


cdef int _fill_row(int64_t* out, object row_ids, Py_ssize_t row, Py_ssize_t size,
                   Py_ssize_t max_len, int64_t pad) except -1:
    """``out[:max_len] = row_ids`` with -1 mapped to ``pad``, then ``pad``."""
    cdef PyObject** items = PySequence_Fast_ITEMS(<PyObject*>row_ids)
    cdef PyObject* item
    cdef long long value
    cdef Py_ssize_t j
    for j in range(size):
        item = items[j]
        if not (PyLong_CheckExact(item) and long_as_compact(item, &value)):
            value = _token_value_slow(item, row, j)
            # __index__ ran Python code: the list may have changed under us.
            if Py_SIZE(<PyObject*>row_ids) != size:
                raise RuntimeError(
                    f"output_token_ids[{row}] changed while it was being read")
            items = PySequence_Fast_ITEMS(<PyObject*>row_ids)
        out[j] = pad if value == -1 else value
    for j in range(size, max_len):
        out[j] = pad
    return 0


cdef int64_t _as_pad(object vocab_size) except? -1:
    """``vocab_size``, checked: the pad value and the mask of -1."""
    cdef int64_t pad
    try:
        pad = vocab_size.__index__()
    except (AttributeError, OverflowError):
        raise TypeError(f"vocab_size must be an int64, got {vocab_size!r}") from None
    if pad < 0:
        raise ValueError(f"vocab_size must not be negative, got {pad}")
    return pad


cdef Py_ssize_t _longest_row(list output_token_ids) except -1:
    """Pass 1: check that every row is a list or tuple; the longest length."""
    cdef Py_ssize_t i, size, max_len = 0
    cdef PyObject* row_ids
    for i in range(PyList_GET_SIZE(output_token_ids)):
        row_ids = PyList_GET_ITEM(output_token_ids, i)
        if not (PyList_Check(row_ids) or PyTuple_Check(row_ids)):
            raise TypeError(
                f"output_token_ids[{i}] must be a list of ints, "
                f"got {type(<object>row_ids).__name__}"
            )
        size = Py_SIZE(row_ids)
        if size > max_len:
            max_len = size
    return max_len


cdef int _fill_rows(list output_token_ids, Py_ssize_t num_rows, int64_t* data,
                    Py_ssize_t max_len, int64_t pad) except -1:
    """Pass 2: every row into ``data`` (``num_rows`` x ``max_len``, C order).

    Python code ran since pass 1 (the allocation): check that the batch still
    fits before writing, never past ``max_len``.  Counts the tensor and its
    token ids in ``stats()`` once every row is written."""
    global _penalty_tensors, _penalty_tokens
    cdef Py_ssize_t i, size, total = 0
    cdef PyObject* row_ids
    for i in range(num_rows):
        if i >= PyList_GET_SIZE(output_token_ids):
            raise RuntimeError("output_token_ids changed while it was being read")
        row_ids = PyList_GET_ITEM(output_token_ids, i)
        if not (PyList_Check(row_ids) or PyTuple_Check(row_ids)):
            raise RuntimeError("output_token_ids changed while it was being read")
        size = Py_SIZE(row_ids)
        if size > max_len:
            raise RuntimeError(
                f"output_token_ids[{i}] changed while it was being read")
        _fill_row(data + i * max_len, <object>row_ids, i, size, max_len, pad)
        total += size
    _penalty_tensors += 1
    _penalty_tokens += total
    return 0


def output_tokens_tensor(list output_token_ids not None, vocab_size,
                         bint pin_memory=False):
    """The int64 ``[num_reqs, max_len]`` CPU tensor of vLLM's penalties.

    ``make_tensor_with_pad(output_token_ids, pad=vocab_size, dtype=int64)``
    with every -1 replaced by ``vocab_size`` (``apply_all_penalties``'
    ``masked_fill_``), pinned if ``pin_memory``.  Stricter than numpy: items
    must be ints (or have ``__index__``); floats and strings raise TypeError.

    Written straight into a new torch tensor, without vLLM's intermediate
    numpy array.
    """
    global _torch_empty, _torch_int64
    cdef Py_ssize_t num_rows = PyList_GET_SIZE(output_token_ids)
    cdef int64_t pad = _as_pad(vocab_size)
    cdef Py_ssize_t max_len = _longest_row(output_token_ids)
    if _torch_empty is None:
        import torch
        _torch_empty, _torch_int64 = torch.empty, torch.int64
    tensor = _torch_empty((num_rows, max_len), dtype=_torch_int64,
                          pin_memory=pin_memory)
    _fill_rows(output_token_ids, num_rows, <int64_t*><uintptr_t>tensor.data_ptr(),
               max_len, pad)
    return tensor


def _fill_output_tokens(list output_token_ids not None, vocab_size, out):
    """``output_tokens_tensor``'s values written into ``out`` instead: a
    writable, C-contiguous 2-D int64 buffer of shape (rows, longest row), a
    numpy array say.  The same code path, for the tests on interpreters that
    have no torch (the int reads differ between CPython 3.11 and 3.12)."""
    cdef Py_ssize_t num_rows = PyList_GET_SIZE(output_token_ids)
    cdef int64_t pad = _as_pad(vocab_size)
    cdef Py_ssize_t max_len = _longest_row(output_token_ids)
    cdef Py_buffer buffer
    PyObject_GetBuffer(out, &buffer, PyBUF_RECORDS)
    try:
        if (buffer.ndim != 2 or buffer.itemsize != 8
                or buffer.format[0] not in (b"q", b"l")
                or not PyBuffer_IsContiguous(&buffer, b"C")
                or buffer.shape[0] != num_rows or buffer.shape[1] != max_len):
            raise ValueError(
                f"out must be a C-contiguous int64 array of shape ({num_rows}, "
                f"{max_len})")
        _fill_rows(output_token_ids, num_rows, <int64_t*>buffer.buf, max_len, pad)
    finally:
        PyBuffer_Release(&buffer)
    return out
