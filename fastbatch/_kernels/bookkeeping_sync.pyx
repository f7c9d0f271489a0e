# Compiler directives are set in setup.py (one place, with a debug switch).
"""Compiled piece ``bookkeeping_sync``: the per-request loop of vLLM's
``GPUModelRunner._bookkeeping_sync``.

Two passes, as every piece: plan (validate, mutate nothing), then apply.
``fastbatch._reference`` holds the same behaviour in plain Python.
"""

__all__ = ["append_sampled_token_ids"]

from cpython.buffer cimport (
    PyBUF_FORMAT,
    PyBUF_STRIDES,
    PyBUF_WRITABLE,
    PyBuffer_Release,
    PyObject_GetBuffer,
)
from cpython.list cimport PyList_Append, PyList_GET_ITEM, PyList_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.object cimport PyObject
from cpython.set cimport PyAnySet_Check, PySet_Contains, PySet_GET_SIZE
from libc.stdint cimport int32_t, uint64_t
from libc.string cimport strcmp

from fastbatch._kernels._common cimport (
    PyDict_GetItemWithError,
    PyList_Check,
    PyList_CheckExact,
    PyList_SetSlice,
    PyLong_AsLongLongAndOverflow,
    PyLong_CheckExact,
    PyObject_CheckBuffer,
    Py_DECREF,
    Py_INCREF,
    Py_XDECREF,
    long_as_compact,
)

# Process-wide counters, read with stats().
cdef uint64_t _bookkeeping_calls = 0
cdef uint64_t _bookkeeping_requests_updated = 0
cdef uint64_t _bookkeeping_tokens_added = 0

# The int -1 that vLLM appends under async scheduling (CPython's cached one).
cdef object _PLACEHOLDER = -1


def stats():
    """This piece's counters since import or the last ``reset_stats()``."""
    return {"calls": _bookkeeping_calls,
            "requests_updated": _bookkeeping_requests_updated,
            "tokens_added": _bookkeeping_tokens_added}


def reset_stats():
    """Set every counter of ``stats()`` back to zero."""
    global _bookkeeping_calls, _bookkeeping_requests_updated, _bookkeeping_tokens_added
    _bookkeeping_calls = _bookkeeping_requests_updated = _bookkeeping_tokens_added = 0


ctypedef struct Update:
    PyObject* output_ids  # the request's output list (strong reference)
    PyObject* sampled_ids  # its row of valid_sampled_token_ids (strong; NULL: async)
    Py_ssize_t index      # row of the batch arrays
    Py_ssize_t start      # num_tokens_no_spec[index] before the step
    Py_ssize_t count      # tokens appended


cdef int _get_array(object array, Py_buffer* view, const char* name, int ndim,
                    const char* format, Py_ssize_t itemsize) except -1:
    """A writable buffer of ``array``, checked to be ``ndim``-D of ``format``."""
    cdef const char* found
    wanted = f"{name.decode()} must be a writable {ndim}-D array of " + (
        "bool" if format[0] == b"?" else "int32")
    if not PyObject_CheckBuffer(array):
        raise TypeError(f"{wanted}, got {type(array).__name__}")
    try:
        PyObject_GetBuffer(array, view, PyBUF_STRIDES | PyBUF_FORMAT | PyBUF_WRITABLE)
    except (BufferError, ValueError) as exc:  # numpy: ValueError if read-only
        raise TypeError(f"{wanted} ({exc})") from None
    found = view.format
    if found == NULL:
        found = "B"  # unsigned bytes, as the buffer protocol says
    if found[0] == b"@" or found[0] == b"=" or found[0] == b"<":
        found += 1  # native order (the batch arrays are made on this machine)
    if view.ndim != ndim or view.itemsize != itemsize or strcmp(found, format) != 0:
        described = f"{view.ndim}-D, format {(<bytes>found).decode()!r}"
        PyBuffer_Release(view)
        raise TypeError(f"{wanted}, got {described}")
    return 0


cdef inline Py_ssize_t _item_offset(Py_buffer* view, Py_ssize_t row,
                                    Py_ssize_t column) noexcept:
    return row * view.strides[0] + column * view.strides[1]


cdef int _check_token(object sampled_ids, Py_ssize_t index, Py_ssize_t j) except -1:
    """An item of a sampled row must be an int that fits token_ids_cpu (int32)."""
    cdef PyObject* item = PyList_GET_ITEM(sampled_ids, j)
    cdef long long value
    cdef int overflow = 0
    if not PyLong_CheckExact(item):
        raise TypeError(f"valid_sampled_token_ids[{index}][{j}] must be an int, "
                        f"got {type(<object>item).__name__}")
    if not long_as_compact(item, &value):
        value = PyLong_AsLongLongAndOverflow(item, &overflow)
    if overflow or value < -2**31 or value >= 2**31:
        raise OverflowError(f"valid_sampled_token_ids[{index}][{j}] = "
                            f"{<object>item} does not fit token_ids_cpu (int32)")
    return 0


cdef int _plan(list req_ids, dict requests, Py_ssize_t num_sampled_tokens,
               list valid_sampled_token_ids, object discarded,
               Py_buffer* num_tokens, Py_buffer* token_ids, Py_buffer* is_token,
               Py_ssize_t max_model_len, Update* plans, Py_ssize_t* planned) except -1:
    """Pass 1: every request vLLM's loop would update, checked; mutates nothing.

    First the lookups (which may run Python code: hashes, attributes), keeping
    strong references; then, with no Python code left to run before pass 2,
    the sampled rows' items and the arrays' bounds.
    """
    cdef Py_ssize_t index, start, count, j, p
    cdef Py_ssize_t num_rows = min(num_tokens.shape[0],
                                   min(token_ids.shape[0], is_token.shape[0]))
    cdef Py_ssize_t width = min(token_ids.shape[1], is_token.shape[1])
    cdef bint check_discarded = discarded is not None and PySet_GET_SIZE(discarded) > 0
    cdef PyObject* state
    cdef Update* plan
    cdef object sampled_ids = None, req_id, output_ids
    for index in range(num_sampled_tokens):
        if valid_sampled_token_ids is None:  # async: one placeholder unless discarded
            if check_discarded and PySet_Contains(discarded, index):
                continue
            count = 1
        else:
            if index >= PyList_GET_SIZE(valid_sampled_token_ids):
                raise IndexError(f"valid_sampled_token_ids has "
                                 f"{PyList_GET_SIZE(valid_sampled_token_ids)} rows, "
                                 f"fewer than the {num_sampled_tokens} sampled")
            sampled_ids = <object>PyList_GET_ITEM(valid_sampled_token_ids, index)
            if not (PyList_CheckExact(<PyObject*>sampled_ids)
                    or PyList_Check(<PyObject*>sampled_ids)):
                raise TypeError(f"valid_sampled_token_ids[{index}] must be a list, "
                                f"got {type(sampled_ids).__name__}")
            count = PyList_GET_SIZE(sampled_ids)
            if count == 0:
                continue  # nothing sampled (or discarded): vLLM skips the request
        if index >= PyList_GET_SIZE(req_ids):
            raise IndexError(f"req_ids has {PyList_GET_SIZE(req_ids)} entries, "
                             f"fewer than the {num_sampled_tokens} sampled")
        req_id = <object>PyList_GET_ITEM(req_ids, index)
        state = PyDict_GetItemWithError(<PyObject*>requests, <PyObject*>req_id)
        if state == NULL:
            raise KeyError(req_id)
        output_ids = (<object>state).output_token_ids
        if not (PyList_CheckExact(<PyObject*>output_ids)
                or PyList_Check(<PyObject*>output_ids)):
            raise TypeError(f"requests[{req_id!r}].output_token_ids must be a list, "
                            f"got {type(output_ids).__name__}")
        plan = &plans[planned[0]]
        plan.output_ids = <PyObject*>output_ids
        plan.sampled_ids = NULL
        plan.index = index
        plan.start = 0
        plan.count = count
        Py_INCREF(<PyObject*>output_ids)
        if valid_sampled_token_ids is not None:
            plan.sampled_ids = <PyObject*>sampled_ids
            Py_INCREF(<PyObject*>sampled_ids)
        planned[0] += 1
    for p in range(planned[0]):
        index, count = plans[p].index, plans[p].count
        if plans[p].sampled_ids != NULL:
            if PyList_GET_SIZE(<object>plans[p].sampled_ids) != count:
                raise RuntimeError(f"valid_sampled_token_ids[{index}] changed "
                                   "during the call")
            for j in range(count):
                _check_token(<object>plans[p].sampled_ids, index, j)
        if index >= num_rows:
            raise IndexError(f"request {index} is beyond the {num_rows} rows of the "
                             "batch arrays")
        start = (<int32_t*>(<char*>num_tokens.buf + index * num_tokens.strides[0]))[0]
        if start + count > max_model_len:
            raise AssertionError(
                "Sampled token IDs exceed the max model length. Total number of "
                f"tokens: {start + count} > max_model_len: {max_model_len}")
        if start < 0 or start + count > width:
            raise IndexError(f"num_tokens_no_spec[{index}] = {start} is out of range "
                             f"for token_ids_cpu's {width} columns")
        plans[p].start = start
    return 0


cdef int _apply(Update* plans, Py_ssize_t planned, Py_buffer* num_tokens,
                Py_buffer* token_ids, Py_buffer* is_token) except -1:
    """Pass 2: vLLM's loop body, request by request, in order."""
    cdef Py_ssize_t p, j, index, start, count
    cdef long long value
    cdef int overflow
    cdef PyObject* sampled_ids
    cdef PyObject* item
    cdef char* token_row
    cdef char* is_token_row
    for p in range(planned):
        index, start, count = plans[p].index, plans[p].start, plans[p].count
        sampled_ids = plans[p].sampled_ids
        token_row = <char*>token_ids.buf + _item_offset(token_ids, index, start)
        is_token_row = <char*>is_token.buf + _item_offset(is_token, index, start)
        for j in range(count):
            if sampled_ids == NULL:
                value = -1
            else:
                item = PyList_GET_ITEM(<object>sampled_ids, j)
                if not long_as_compact(item, &value):
                    value = PyLong_AsLongLongAndOverflow(item, &overflow)
            (<int32_t*>(token_row + j * token_ids.strides[1]))[0] = <int32_t>value
            is_token_row[j * is_token.strides[1]] = 1
        (<int32_t*>(<char*>num_tokens.buf + index * num_tokens.strides[0]))[0] = (
            <int32_t>(start + count))
        if sampled_ids == NULL:
            PyList_Append(<object>plans[p].output_ids, _PLACEHOLDER)
        elif count == 1:
            PyList_Append(<object>plans[p].output_ids,
                          <object>PyList_GET_ITEM(<object>sampled_ids, 0))
        else:
            j = PyList_GET_SIZE(<object>plans[p].output_ids)
            PyList_SetSlice(plans[p].output_ids, j, j, sampled_ids)
    return 0


def append_sampled_token_ids(list req_ids not None, dict requests not None,
                             Py_ssize_t num_sampled_tokens, list valid_sampled_token_ids,
                             discarded, num_tokens_no_spec, token_ids_cpu, is_token_ids,
                             Py_ssize_t max_model_len):
    """Append this step's sampled tokens to each request's state.

    The per-request loop of vLLM's ``GPUModelRunner._bookkeeping_sync`` (vLLM
    0.31.0 to 0.33.0), for requests ``0 .. num_sampled_tokens - 1``.  With
    ``valid_sampled_token_ids`` None (async scheduling) each request not in the
    set ``discarded`` gets one placeholder ``-1``; otherwise request ``i`` gets
    the ints of the list ``valid_sampled_token_ids[i]`` (skipped if empty).
    For each: the tokens go to ``token_ids_cpu[i, start:end]``,
    ``is_token_ids[i, start:end] = True``, ``num_tokens_no_spec[i] = end``
    (``start`` its old value) and ``requests[req_ids[i]].output_token_ids`` is
    extended in place (the same list object as the input batch's).

    Everything is checked before anything changes; then a clear exception:
    AssertionError (vLLM's, ``end > max_model_len``), KeyError (no state for a
    request), IndexError, TypeError (not lists/ints, arrays that are not the
    batch's int32/bool arrays), OverflowError (a token id beyond int32).
    Returns the number of requests updated.
    """
    global _bookkeeping_calls, _bookkeeping_requests_updated, _bookkeeping_tokens_added
    cdef Py_buffer num_tokens, token_ids, is_token
    cdef Py_ssize_t p, planned = 0, added = 0
    cdef Update* plans = NULL
    if discarded is not None and not PyAnySet_Check(discarded):
        raise TypeError(f"discarded must be a set or None, got {type(discarded).__name__}")
    if num_sampled_tokens < 0:
        raise ValueError(f"num_sampled_tokens must be >= 0, got {num_sampled_tokens}")
    _bookkeeping_calls += 1
    _get_array(num_tokens_no_spec, &num_tokens, b"num_tokens_no_spec", 1, b"i", 4)
    try:
        _get_array(token_ids_cpu, &token_ids, b"token_ids_cpu", 2, b"i", 4)
        try:
            _get_array(is_token_ids, &is_token, b"is_token_ids", 2, b"?", 1)
            try:
                if num_sampled_tokens == 0:
                    return 0
                plans = <Update*>PyMem_Malloc(num_sampled_tokens * sizeof(Update))
                if plans == NULL:
                    raise MemoryError()
                try:
                    _plan(req_ids, requests, num_sampled_tokens, valid_sampled_token_ids,
                          discarded, &num_tokens, &token_ids, &is_token, max_model_len,
                          plans, &planned)
                    _apply(plans, planned, &num_tokens, &token_ids, &is_token)
                    for p in range(planned):
                        added += plans[p].count
                    _bookkeeping_requests_updated += planned
                    _bookkeeping_tokens_added += added
                    return planned
                finally:
                    for p in range(planned):
                        Py_DECREF(plans[p].output_ids)
                        Py_XDECREF(plans[p].sampled_ids)
                    PyMem_Free(plans)
            finally:
                PyBuffer_Release(&is_token)
        finally:
            PyBuffer_Release(&token_ids)
    finally:
        PyBuffer_Release(&num_tokens)
