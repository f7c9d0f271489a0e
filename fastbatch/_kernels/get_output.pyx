# Compiler directives are set in setup.py (one place, with a debug switch).
"""Compiled piece ``get_output``: the sampled-token lists of vLLM's
``AsyncGPUModelRunnerOutput.get_output`` (plain decode, one id per request).

vLLM does ``sampled_token_ids_cpu.tolist()`` and then ``.clear()``s the rows
of the discarded requests.  ``sampled_token_lists`` builds the same lists in
one pass over the tensor's memory, the ids as the shared token-id objects,
the discarded rows straight away as empty lists.  ``fastbatch._reference``
holds the same behaviour in plain Python.
"""

__all__ = ["sampled_token_lists"]

from cpython.buffer cimport PyBuffer_Release
from cpython.mem cimport PyMem_Calloc, PyMem_Free
from cpython.object cimport PyObject
from libc.stdint cimport uint64_t

from fastbatch._kernels._common cimport (
    PyList_CheckExact,
    PyTuple_Check,
    Py_SIZE,
    SampledIds,
    flag_rows,
    rows_to_lists,
    view_ids,
)

# Process-wide counters, read with stats().
cdef uint64_t _calls = 0
cdef uint64_t _rows = 0


def stats():
    """This piece's counters since import or the last ``reset_stats()``."""
    return {"calls": _calls, "rows": _rows}


def reset_stats():
    """Set every counter of ``stats()`` back to zero."""
    global _calls, _rows
    _calls = _rows = 0


def sampled_token_lists(sampled_token_ids, invalid_req_indices=()):
    """vLLM's ``sampled_token_ids_cpu.tolist()`` followed by
    ``valid_sampled_token_ids[i].clear()`` for each ``i`` in
    ``invalid_req_indices`` (``AsyncGPUModelRunnerOutput.get_output``, one id
    per request); indices checked before the lists are built.

    ``sampled_token_ids`` is a 2-D int32 or int64 CPU tensor (or buffer);
    ``invalid_req_indices`` an iterable of row indices, read as a list's
    indexing reads them (negative from the end, out of range an IndexError).
    Returns a new list of plain lists of plain ints.
    """
    global _calls, _rows
    cdef SampledIds ids
    cdef Py_buffer buffer
    cdef bint have_buffer = False
    cdef unsigned char* cleared = NULL
    view_ids(sampled_token_ids, &ids, &buffer, &have_buffer, "sampled_token_ids")
    try:
        if not ((PyList_CheckExact(<PyObject*>invalid_req_indices)
                 or PyTuple_Check(<PyObject*>invalid_req_indices))
                and Py_SIZE(<PyObject*>invalid_req_indices) == 0):
            cleared = <unsigned char*>PyMem_Calloc(ids.num_rows + 1, 1)
            if cleared == NULL:
                raise MemoryError()
            flag_rows(invalid_req_indices, ids.num_rows, cleared,
                      "invalid_req_indices", False)
        rows = rows_to_lists(&ids, ids.num_rows, ids.width, cleared)
    finally:
        PyMem_Free(cleared)
        if have_buffer:
            PyBuffer_Release(&buffer)
    _calls += 1
    _rows += ids.num_rows
    return rows
