# Compiler directives are set in setup.py (one place, with a debug switch).
"""Compiled piece ``prepare_input_ids``: the per-request loop of vLLM's
``GPUModelRunner._prepare_input_ids`` (async scheduling).

Two passes: plan (look every common request up, validate, compute its
indices, allocate nothing the caller sees), then write the index arrays,
allocated at their exact sizes.  ``fastbatch._reference`` holds the same
behaviour in plain Python.
"""

__all__ = ["prepare_input_ids_indices"]

from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.object cimport PyObject, PyObject_Length
from libc.stdint cimport int32_t, int64_t, uint64_t

from fastbatch._kernels._common cimport (
    PyDict_GetItemWithError,
    PyList_CheckExact,
    view_int_column,
)

import operator

cdef extern from *:
    bint add_overflow "__builtin_add_overflow"(int64_t a, int64_t b, int64_t* out) noexcept nogil
    bint sub_overflow "__builtin_sub_overflow"(int64_t a, int64_t b, int64_t* out) noexcept nogil
    bint mul_overflow "__builtin_mul_overflow"(int64_t a, int64_t b, int64_t* out) noexcept nogil

# Process-wide counters, read with stats().
cdef uint64_t _input_ids_calls = 0
cdef uint64_t _input_ids_common_requests = 0
cdef uint64_t _input_ids_spec_tokens = 0

cdef object _numpy_empty = None  # numpy.empty and numpy.int64, imported on
cdef object _numpy_int64 = None  # first use (fastbatch itself needs no numpy)


def stats():
    """This piece's counters since import or the last ``reset_stats()``."""
    return {"calls": _input_ids_calls,
            "common_requests": _input_ids_common_requests,
            "spec_tokens": _input_ids_spec_tokens}


def reset_stats():
    """Set every counter of ``stats()`` back to zero."""
    global _input_ids_calls, _input_ids_common_requests, _input_ids_spec_tokens
    _input_ids_calls = _input_ids_common_requests = _input_ids_spec_tokens = 0


ctypedef struct CommonRequest:
    int64_t sample_index  # flattened index of the sampled token
    int64_t prev_index    # row of the request in the previous step
    int64_t draft_len     # its scheduled draft tokens
    int64_t draft_start   # prev_index * prev_num_spec_tokens


cdef inline int64_t _item(const Py_buffer* view, Py_ssize_t index) noexcept nogil:
    """Item ``index`` of an acquired int32 or int64 column, widened."""
    cdef const char* at = <const char*>view.buf + index * view.strides[0]
    if view.itemsize == 8:
        return (<const int64_t*>at)[0]
    return (<const int32_t*>at)[0]


cdef int64_t _as_int64(object value, str name) except? -1:
    cdef int64_t result
    try:
        result = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    except OverflowError:
        raise OverflowError(f"{name} = {value} does not fit in int64") from None
    return result


cdef Py_ssize_t _plan(list req_ids, const Py_buffer* positions, const Py_buffer* cu,
                      dict scheduled_spec_tokens, int64_t prev_num_spec_tokens,
                      Py_ssize_t num_reqs, CommonRequest* plans, int64_t* total_spec,
                      bint* indices_match, int64_t* max_flattened) except -1:
    """Pass 1: vLLM's loop, recording each common request's numbers in ``plans``.

    Returns the number of common requests; sets the totals.  Raises where
    vLLM's loop would index out of range, and where an index does not fit in
    int64 (the tensors vLLM builds from them are int64).
    """
    cdef Py_ssize_t cur_index, count = 0, draft_len
    cdef int64_t prev_index, flattened, value
    cdef PyObject* draft
    cdef object req_id  # strong: the dict lookup may run Python code
    for cur_index in range(num_reqs):
        if cur_index >= positions.shape[0]:
            raise IndexError(f"prev_positions has {positions.shape[0]} entries for "
                             f"{num_reqs} requests")
        prev_index = _item(positions, cur_index)
        if prev_index < 0:
            continue  # new this step: its input ids are already on the CPU
        if cur_index >= PyList_GET_SIZE(req_ids):
            raise IndexError(f"req_ids has {PyList_GET_SIZE(req_ids)} entries, request "
                             f"{cur_index} has a previous row")
        req_id = <object>PyList_GET_ITEM(req_ids, cur_index)
        draft = PyDict_GetItemWithError(<PyObject*>scheduled_spec_tokens,
                                        <PyObject*>req_id)
        if draft == NULL:
            draft_len = 0
        elif PyList_CheckExact(draft):
            draft_len = PyList_GET_SIZE(<object>draft)
        else:
            draft_len = PyObject_Length(<object>draft)
        if cur_index >= cu.shape[0]:
            raise IndexError(f"cu_num_tokens has {cu.shape[0]} entries, request "
                             f"{cur_index} has a previous row")
        total_spec[0] += draft_len
        flattened = _item(cu, cur_index)
        if (sub_overflow(flattened, 1, &flattened)
                or sub_overflow(flattened, draft_len, &plans[count].sample_index)
                or mul_overflow(prev_index, prev_num_spec_tokens,
                                &plans[count].draft_start)
                or add_overflow(plans[count].draft_start, draft_len, &value)):
            raise OverflowError(f"the input ids indices of request {cur_index} do not "
                                "fit in int64")
        plans[count].prev_index = prev_index
        plans[count].draft_len = draft_len
        indices_match[0] = indices_match[0] and prev_index == flattened
        if flattened > max_flattened[0]:
            max_flattened[0] = flattened
        count += 1
    return count


cdef object _index_rows(Py_ssize_t width, Py_buffer* view):
    """A new (2, width) int64 array, acquired into ``view`` (caller releases)."""
    rows = _numpy_empty((2, width), dtype=_numpy_int64)
    PyObject_GetBuffer(rows, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)
    return rows


cdef void _fill(const CommonRequest* plans, Py_ssize_t count, int64_t* common,
                int64_t* spec, Py_ssize_t total_spec) noexcept nogil:
    """Pass 2: the index rows, in vLLM's order."""
    cdef Py_ssize_t p, k, at = 0
    cdef int64_t first_spec
    for p in range(count):
        common[p] = plans[p].sample_index
        common[count + p] = plans[p].prev_index
        first_spec = plans[p].sample_index + 1
        for k in range(plans[p].draft_len):
            spec[at] = first_spec + k
            spec[total_spec + at] = plans[p].draft_start + k
            at += 1


def prepare_input_ids_indices(list req_ids not None, prev_positions, cu_num_tokens,
                              dict scheduled_spec_tokens not None, prev_num_spec_tokens,
                              Py_ssize_t num_reqs):
    """vLLM's ``GPUModelRunner._prepare_input_ids`` loop (0.31.0 to 0.33.0),
    its lists returned as two new (2, n) int64 numpy arrays:
    ``(common, spec, common_indices_match, max_flattened_index)`` with
    ``common = [sample_flattened_indices, prev_indices]`` and
    ``spec = [spec_flattened_indices, prev_draft_token_indices]``.

    For each of the first ``num_reqs`` requests whose ``prev_positions`` entry
    (int64) is >= 0 (a request of the previous step), in order, with
    ``draft_len = len(scheduled_spec_tokens.get(req_id, ()))`` and
    ``flattened = cu_num_tokens[i] - 1`` (int32 or int64): the sampled token's
    index ``flattened - draft_len``, the previous row, the draft tokens'
    indices ``flattened - draft_len + 1 .. flattened`` and their rows in the
    flattened previous drafts ``prev_index * prev_num_spec_tokens + 0 ..``
    (``spec`` has vLLM's ``total_num_spec_tokens`` columns).  Nothing is
    allocated unless every request is valid.
    """
    global _numpy_empty, _numpy_int64
    global _input_ids_calls, _input_ids_common_requests, _input_ids_spec_tokens
    cdef Py_buffer positions, cu, common_view, spec_view
    cdef int64_t spec_tokens = _as_int64(prev_num_spec_tokens, "prev_num_spec_tokens")
    cdef int64_t total_spec = 0, max_flattened = -1
    cdef bint indices_match = True
    cdef Py_ssize_t count = 0
    cdef CommonRequest* plans = NULL
    if num_reqs < 0:
        raise ValueError(f"num_reqs must be >= 0, got {num_reqs}")
    if _numpy_empty is None:
        import numpy
        _numpy_empty, _numpy_int64 = numpy.empty, numpy.int64
    view_int_column(prev_positions, "prev_positions", &positions, 0, False)
    try:
        view_int_column(cu_num_tokens, "cu_num_tokens", &cu, 0, True)
        try:
            if num_reqs:
                plans = <CommonRequest*>PyMem_Malloc(num_reqs * sizeof(CommonRequest))
                if plans == NULL:
                    raise MemoryError()
            count = _plan(req_ids, &positions, &cu, scheduled_spec_tokens, spec_tokens,
                          num_reqs, plans, &total_spec, &indices_match, &max_flattened)
            common = _index_rows(count, &common_view)
            try:
                spec = _index_rows(total_spec, &spec_view)
                try:
                    _fill(plans, count, <int64_t*>common_view.buf,
                          <int64_t*>spec_view.buf, total_spec)
                finally:
                    PyBuffer_Release(&spec_view)
            finally:
                PyBuffer_Release(&common_view)
        finally:
            PyMem_Free(plans)
            PyBuffer_Release(&cu)
    finally:
        PyBuffer_Release(&positions)
    _input_ids_calls += 1
    _input_ids_common_requests += count
    _input_ids_spec_tokens += total_spec
    return common, spec, indices_match, max_flattened
