# Compiler directives are set in setup.py (one place, with a debug switch).
"""Compiled piece ``async_spec_token_ids``: the loop of vLLM's
``InputBatch.update_async_spec_token_ids``.

Two passes, as every piece: plan (validate, mutate nothing), then apply.
``fastbatch._reference`` holds the same behaviour in plain Python.
"""

__all__ = ["update_async_spec_token_ids"]

from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.object cimport PyObject
from libc.stdint cimport uint64_t

from fastbatch._kernels._common cimport (
    MAX_INLINE_TAIL,
    PyDict_GetItemWithError,
    PyList_Check,
    PyList_CheckExact,
    PyList_SetSlice,
    Py_DECREF,
    Py_INCREF,
    Py_None,
    Py_SET_SIZE,
    Py_XDECREF,
    as_row,
    list_set_item,
)

# Process-wide counters, read with stats().
cdef uint64_t _spec_calls = 0
cdef uint64_t _spec_requests_updated = 0


def stats():
    """This piece's counters since import or the last ``reset_stats()``."""
    return {"calls": _spec_calls, "requests_updated": _spec_requests_updated}


def reset_stats():
    """Set every counter of ``stats()`` back to zero."""
    global _spec_calls, _spec_requests_updated
    _spec_calls = _spec_requests_updated = 0


ctypedef struct SpecUpdate:
    PyObject* spec_ids   # strong references (draft_ids may be NULL: skip),
    PyObject* draft_ids  # released when the call ends
    Py_ssize_t index     # position in the batch
    Py_ssize_t row       # row of draft_token_ids (vLLM's prev_index)


cdef int _plan_spec(list req_ids, dict prev_req_id_to_index, list spec_token_ids,
                    list draft_token_ids, SpecUpdate* plans,
                    Py_ssize_t* count) except -1:
    """Pass 1: record (spec list, draft list) for every request vLLM would update.

    Mutates nothing.  Empty lists are skipped for good: the update only ever
    shortens a list, so an empty one cannot become non-empty later in the loop.
    The draft rows are fetched in a second, tight loop: the lookups' loop is
    long (a dict lookup per request), and a short one lets the CPU overlap the
    cache misses on the freshly made draft lists.
    """
    cdef Py_ssize_t index, p, row
    cdef Py_ssize_t num_reqs = min(PyList_GET_SIZE(req_ids),
                                   PyList_GET_SIZE(spec_token_ids))
    cdef Py_ssize_t num_drafts = PyList_GET_SIZE(draft_token_ids)
    cdef PyObject* prev_index
    cdef PyObject* draft
    cdef object spec_ids, req_id  # strong: the dict lookup may run Python code
    for index in range(num_reqs):
        spec_ids = <object>PyList_GET_ITEM(spec_token_ids, index)
        if spec_ids is None:
            continue
        if not (PyList_CheckExact(<PyObject*>spec_ids)
                or PyList_Check(<PyObject*>spec_ids)):
            raise TypeError(
                f"spec_token_ids[{index}] must be a list or None, "
                f"got {type(spec_ids).__name__}"
            )
        if PyList_GET_SIZE(spec_ids) == 0:
            continue  # no draft tokens scheduled for this request
        req_id = <object>PyList_GET_ITEM(req_ids, index)
        prev_index = PyDict_GetItemWithError(<PyObject*>prev_req_id_to_index,
                                             <PyObject*>req_id)
        if prev_index == NULL or prev_index == Py_None:
            continue
        row = as_row(<PyObject*>req_id, prev_index)
        if row >= num_drafts:
            raise IndexError(
                f"prev_req_id_to_index[{req_id!r}] = {row} is out of range for "
                f"{num_drafts} draft rows"
            )
        Py_INCREF(<PyObject*>spec_ids)
        plans[count[0]] = SpecUpdate(<PyObject*>spec_ids, NULL, index, row)
        count[0] += 1
    for p in range(count[0]):
        draft = PyList_GET_ITEM(draft_token_ids, plans[p].row)
        if draft == Py_None:
            continue
        if not (PyList_CheckExact(draft) or PyList_Check(draft)):
            raise TypeError(
                f"draft_token_ids[{plans[p].row}] must be a list or None, "
                f"got {type(<object>draft).__name__}"
            )
        if PyList_GET_SIZE(<object>draft) != 0:
            Py_INCREF(draft)
            plans[p].draft_ids = draft
    return 0


cdef int _assign_items(PyObject* target, PyObject* source) except -1:
    """``target[:] = source`` for two distinct lists (vLLM's clear + extend).

    Up to MAX_INLINE_TAIL items in place, as ``_replace_tail`` does: the final
    state is reached before any replaced item is released.
    """
    cdef PyObject* replaced[MAX_INLINE_TAIL]
    cdef PyObject* item
    cdef Py_ssize_t i
    cdef Py_ssize_t old_size = PyList_GET_SIZE(<object>target)
    cdef Py_ssize_t new_size = PyList_GET_SIZE(<object>source)
    if old_size > MAX_INLINE_TAIL or new_size > old_size:
        return PyList_SetSlice(target, 0, old_size, source)
    # One loop, item by item: a separate copy of the replaced items compiles
    # to ``rep movsq``, whose start-up cost dominates at these sizes.
    for i in range(new_size):
        item = PyList_GET_ITEM(<object>source, i)
        Py_INCREF(item)
        replaced[i] = PyList_GET_ITEM(<object>target, i)
        list_set_item(target, i, item)
    for i in range(new_size, old_size):
        replaced[i] = PyList_GET_ITEM(<object>target, i)
    Py_SET_SIZE(target, new_size)
    for i in range(old_size):
        Py_DECREF(replaced[i])
    return 0


cdef Py_ssize_t _apply_spec(SpecUpdate* plans, Py_ssize_t count) except -1:
    """Pass 2: vLLM's ``del draft_ids[len(spec_ids):]; spec_ids[:] = draft_ids``,
    request by request and in order, so lists shared between requests end up
    exactly as vLLM leaves them."""
    cdef Py_ssize_t p, spec_size, draft_size
    cdef Py_ssize_t updated = 0
    cdef PyObject* spec_ids
    cdef PyObject* draft_ids
    for p in range(count):
        spec_ids, draft_ids = plans[p].spec_ids, plans[p].draft_ids
        if draft_ids == NULL:
            continue  # an empty or None draft row: vLLM skips the request
        spec_size = PyList_GET_SIZE(<object>spec_ids)
        draft_size = PyList_GET_SIZE(<object>draft_ids)
        if spec_size == 0 or draft_size == 0:
            continue  # emptied earlier in this loop (lists shared by requests)
        if draft_size > spec_size:
            PyList_SetSlice(draft_ids, spec_size, draft_size, NULL)
        if spec_ids == draft_ids:  # clear() then extend() with itself: empty
            PyList_SetSlice(spec_ids, 0, PyList_GET_SIZE(<object>spec_ids), NULL)
        else:
            _assign_items(spec_ids, draft_ids)
        updated += 1
    return updated


def update_async_spec_token_ids(list req_ids not None,
                                dict prev_req_id_to_index not None,
                                list spec_token_ids not None,
                                list draft_token_ids not None):
    """vLLM's ``InputBatch.update_async_spec_token_ids`` loop, after its early
    returns (vLLM 0.21.0 to 0.33.0).

    For each request in order (``zip`` of ``req_ids`` and ``spec_token_ids``)
    whose spec list is non-empty and whose id maps to a non-empty draft row:
    ``del draft[len(spec):]`` and ``spec[:] = draft``.  Contract, checked
    before any list changes: the three containers are lists and the dict a
    dict; examined spec entries and draft rows are lists or ``None`` (skipped);
    ``prev_index`` is an int in ``range(len(draft_token_ids))``.  Returns the
    number of requests updated.
    """
    global _spec_calls, _spec_requests_updated
    cdef Py_ssize_t p, count = 0, updated
    cdef Py_ssize_t num_reqs = min(PyList_GET_SIZE(req_ids),
                                   PyList_GET_SIZE(spec_token_ids))
    _spec_calls += 1
    if num_reqs == 0:
        return 0
    cdef SpecUpdate* plans = <SpecUpdate*>PyMem_Malloc(num_reqs * sizeof(SpecUpdate))
    if plans == NULL:
        raise MemoryError()
    try:
        _plan_spec(req_ids, prev_req_id_to_index, spec_token_ids, draft_token_ids,
                   plans, &count)
        updated = _apply_spec(plans, count)
        _spec_requests_updated += updated
        return updated
    finally:
        for p in range(count):
            Py_DECREF(plans[p].spec_ids)
            Py_XDECREF(plans[p].draft_ids)
        PyMem_Free(plans)
