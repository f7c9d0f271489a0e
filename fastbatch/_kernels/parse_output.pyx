# Compiler directives are set in setup.py (one place, with a debug switch).
"""Compiled piece ``parse_output``: the token lists of vLLM's
``RejectionSampler.parse_output`` (speculative decoding).

vLLM turns the tensor into a numpy array, masks it with
``(ids != -1) & (ids < vocab_size)``, sets the discarded rows' mask to False
and does ``row[mask[i]].tolist()`` per row.  ``rejection_output_lists`` builds
the same lists in one pass over the tensor's memory (a count, then a fill, per
row), the ids as the shared token-id objects.  ``fastbatch._reference`` holds
the same behaviour in plain Python.
"""

__all__ = ["rejection_output_lists"]

from cpython.buffer cimport PyBuffer_Release
from cpython.mem cimport PyMem_Calloc, PyMem_Free
from cpython.object cimport PyObject
from libc.stdint cimport INT64_MAX, INT64_MIN, int64_t, uint64_t

from fastbatch._kernels._common cimport (
    PyList_CheckExact,
    PyTuple_Check,
    Py_SIZE,
    SampledIds,
    flag_rows,
    valid_rows_to_lists,
    view_ids,
)

import operator

# Process-wide counters, read with stats().
cdef uint64_t _calls = 0
cdef uint64_t _rows = 0
cdef uint64_t _tokens = 0


def stats():
    """This piece's counters since import or the last ``reset_stats()``."""
    return {"calls": _calls, "rows": _rows,
            "tokens": _tokens}


def reset_stats():
    """Set every counter of ``stats()`` back to zero."""
    global _calls, _rows, _tokens
    _calls = _rows = _tokens = 0


cdef int64_t _as_vocab_size(object vocab_size) except? -1:
    """``vocab_size`` as an int64 bound: a bigger or smaller int compares
    like the int64 extremes (as numpy compares Python ints)."""
    try:
        value = operator.index(vocab_size)
    except TypeError:
        raise TypeError(f"vocab_size must be an int, got "
                        f"{type(vocab_size).__name__}") from None
    if value > INT64_MAX:
        return INT64_MAX  # every id is below it, as below the real bound
    if value < INT64_MIN:
        return INT64_MIN
    return value


def rejection_output_lists(output_token_ids, vocab_size, discard_req_indices=()):
    """The token lists of vLLM's ``RejectionSampler.parse_output``: per row,
    the ids that are not -1 and are below ``vocab_size``, in order; the rows
    ``discard_req_indices`` (read as numpy's fancy indexing reads a list of
    ints or a 1-D integer array) empty.

    ``output_token_ids`` is a 2-D int32 or int64 CPU tensor (or buffer).
    ``discard_req_indices`` may also be an empty sequence (negative indices
    from the end, out of range an IndexError); anything else is a TypeError.
    Everything is checked before any list is built.  Returns a new list of
    plain lists of plain ints.
    """
    global _calls, _rows, _tokens
    cdef SampledIds ids
    cdef Py_buffer buffer
    cdef bint have_buffer = False
    cdef unsigned char* discarded = NULL
    cdef int64_t bound = _as_vocab_size(vocab_size)
    cdef Py_ssize_t row, tokens = 0
    view_ids(output_token_ids, &ids, &buffer, &have_buffer, "output_token_ids")
    try:
        if not ((PyList_CheckExact(<PyObject*>discard_req_indices)
                 or PyTuple_Check(<PyObject*>discard_req_indices))
                and Py_SIZE(<PyObject*>discard_req_indices) == 0):
            discarded = <unsigned char*>PyMem_Calloc(ids.num_rows + 1, 1)
            if discarded == NULL:
                raise MemoryError()
            flag_rows(discard_req_indices, ids.num_rows, discarded,
                      "discard_req_indices", True)
        rows = valid_rows_to_lists(&ids, bound, discarded)
    finally:
        PyMem_Free(discarded)
        if have_buffer:
            PyBuffer_Release(&buffer)
    for row in range(ids.num_rows):
        tokens += Py_SIZE(<PyObject*>rows[row])
    _calls += 1
    _rows += ids.num_rows
    _tokens += tokens
    return rows
