# Compiler directives are set in setup.py (one place, with a debug switch).
"""Compiled piece ``prev_positions``: the loop of vLLM's
``GPUModelRunner._compute_prev_positions``.

Two passes, as every piece: plan (look every request up and validate, write
nothing), then write the whole column at once.  ``fastbatch._reference``
holds the same behaviour in plain Python.
"""

__all__ = ["compute_prev_positions"]

from cpython.buffer cimport PyBUF_WRITABLE, PyBuffer_Release
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.object cimport PyObject
from libc.stdint cimport int64_t, uint64_t
from libc.string cimport memcpy

import operator

from fastbatch._kernels._common cimport (
    PyDict_GetItemWithError,
    PyLong_AsLongLongAndOverflow,
    PyLong_CheckExact,
    long_as_compact,
    view_int_column,
)

# Process-wide counters, read with stats().
cdef uint64_t _prev_positions_calls = 0
cdef uint64_t _prev_positions_found = 0


def stats():
    """This piece's counters since import or the last ``reset_stats()``."""
    return {"calls": _prev_positions_calls,
            "found": _prev_positions_found}


def reset_stats():
    """Set every counter of ``stats()`` back to zero."""
    global _prev_positions_calls, _prev_positions_found
    _prev_positions_calls = _prev_positions_found = 0


cdef int64_t _as_position(object req_id, PyObject* value) except? -1:
    """``value`` (a prev_req_id_to_index entry) as numpy's int64 store takes it."""
    cdef long long result
    cdef int overflow = 0
    if PyLong_CheckExact(value) and long_as_compact(value, &result):
        return result
    try:
        as_int = operator.index(<object>value)
    except TypeError:
        raise TypeError(f"prev_req_id_to_index[{req_id!r}] must be an int, "
                        f"got {type(<object>value).__name__}") from None
    result = PyLong_AsLongLongAndOverflow(<PyObject*>as_int, &overflow)
    if overflow:
        raise OverflowError(f"prev_req_id_to_index[{req_id!r}] = {<object>value} "
                            "does not fit in int64")
    return result


def compute_prev_positions(list req_ids not None, dict prev_req_id_to_index not None,
                           prev_positions, Py_ssize_t num_reqs):
    """vLLM's ``GPUModelRunner._compute_prev_positions`` loop (0.21.0 to 0.33.0):
    ``prev_positions[i] = prev_req_id_to_index.get(req_id, -1)`` for each
    ``i, req_id`` of ``enumerate(req_ids[:num_reqs])``, written only once
    every request is valid.  Returns the number of requests found in the map.

    ``prev_positions`` is an int64 array (all of it: the first ``num_reqs``
    entries are the ones vLLM's slice covers).  Valid: each value found is an
    int that fits in int64, and there is a slot for every request.
    """
    global _prev_positions_calls, _prev_positions_found
    cdef Py_buffer view
    cdef Py_ssize_t index, found = 0
    cdef Py_ssize_t count = min(num_reqs, PyList_GET_SIZE(req_ids))
    cdef int64_t* values
    cdef PyObject* value
    cdef object req_id  # strong: the dict lookup may run Python code
    if num_reqs < 0:
        raise ValueError(f"num_reqs must be >= 0, got {num_reqs}")
    view_int_column(prev_positions, "prev_positions", &view, PyBUF_WRITABLE, False)
    values = NULL
    try:
        if count > view.shape[0]:
            raise IndexError(f"prev_positions has {view.shape[0]} slots for "
                             f"{count} requests")
        _prev_positions_calls += 1
        if count == 0:
            return 0
        values = <int64_t*>PyMem_Malloc(count * sizeof(int64_t))
        if values == NULL:
            raise MemoryError()
        for index in range(count):
            req_id = <object>PyList_GET_ITEM(req_ids, index)
            value = PyDict_GetItemWithError(<PyObject*>prev_req_id_to_index,
                                            <PyObject*>req_id)
            if value == NULL:
                values[index] = -1
            else:
                values[index] = _as_position(req_id, value)
                found += 1
        if view.strides[0] == sizeof(int64_t):
            memcpy(view.buf, values, count * sizeof(int64_t))
        else:
            for index in range(count):
                (<int64_t*>(<char*>view.buf + index * view.strides[0]))[0] = values[index]
        _prev_positions_found += found
        return found
    finally:
        PyMem_Free(values)
        PyBuffer_Release(&view)
