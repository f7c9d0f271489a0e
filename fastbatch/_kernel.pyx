# Compiler directives are set in setup.py (one place, with a debug switch).
"""Compiled kernel: vLLM's async output-token update, one call per step.

``update_async_output_token_ids`` does for a whole batch what vLLM's
``InputBatch.update_async_output_token_ids`` does one request at a time in
Python: swap the trailing ``-1`` placeholders of each request's output list for
the token ids sampled one step earlier.  ``fastbatch._reference`` holds the same
behaviour in plain Python; the tests hold the two, and vLLM, to each other.

The work is split in two passes so that bad input never leaves a half-updated
batch:

1. *Plan* (nothing mutated, no synchronisation, no sampled value read): look
   every request up, validate it, and record which list takes which row and
   where its trailing run of placeholders starts (a C-level reverse scan).
2. *Apply*: synchronise the copy-ready event once, only if some request needs
   ids (exactly when vLLM would), then write the sampled ids in place and drop
   surplus placeholders.  The common decode case (one placeholder, one id) is
   one ``PyList_SetItem``: no list is allocated.
"""

from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE, PyList_SetItem
from cpython.long cimport PyLong_FromLongLong
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF
from libc.stdint cimport int32_t, int64_t, uint64_t

cdef extern from "Python.h":
    # Borrowed-pointer forms: Cython's bundled declarations take ``object``
    # arguments, which would add reference-count traffic to the hot loop.
    PyObject* PyDict_GetItemWithError(object mp, object key) except? NULL
    bint PyList_Check(PyObject* o)
    bint PyLong_Check(PyObject* o)
    bint PyObject_CheckBuffer(object o)
    long long PyLong_AsLongLongAndOverflow(PyObject* o, int* overflow) except? -1
    PyObject* Py_None
    # itemlist NULL deletes the slice (no list is allocated).
    int PyList_SetSlice(object lst, Py_ssize_t low, Py_ssize_t high,
                        PyObject* itemlist) except -1


ctypedef struct PlannedUpdate:
    Py_ssize_t index              # position in the batch (req_ids, output lists)
    Py_ssize_t row                # row of the sampled ids (vLLM's prev_index)
    Py_ssize_t first_placeholder  # start of the trailing run of -1
    Py_ssize_t list_size          # length of the output list when planned


# Process-wide counters, read with stats(): they let a test, or a user, prove
# that the fast path really ran and really replaced placeholders.
cdef uint64_t _calls = 0
cdef uint64_t _syncs = 0
cdef uint64_t _requests_updated = 0
cdef uint64_t _tokens_written = 0
cdef uint64_t _placeholders_dropped = 0


def stats():
    """Counters since import or the last ``reset_stats()``, as a dict."""
    return {
        "calls": _calls,
        "syncs": _syncs,
        "requests_updated": _requests_updated,
        "tokens_written": _tokens_written,
        "placeholders_dropped": _placeholders_dropped,
    }


def reset_stats():
    """Set every counter of ``stats()`` back to zero."""
    global _calls, _syncs, _requests_updated, _tokens_written
    global _placeholders_dropped
    _calls = _syncs = _requests_updated = _tokens_written = 0
    _placeholders_dropped = 0


cdef inline bint _is_placeholder(PyObject* item, Py_ssize_t request,
                                 Py_ssize_t position) except -1:
    """True if ``item`` is the int -1, False for another int, else TypeError."""
    cdef int overflow = 0
    cdef long long value
    if not PyLong_Check(item):
        raise TypeError(
            f"output_token_ids[{request}][{position}] must be an int, "
            f"got {type(<object>item).__name__}"
        )
    value = PyLong_AsLongLongAndOverflow(item, &overflow)
    return overflow == 0 and value == -1


cdef Py_ssize_t _as_row(object req_id, object prev_index) except -1:
    """vLLM's ``prev_index`` as a row number: an int >= 0, else a clear error.

    (vLLM would wrap a negative index around; that is never what was meant.)
    """
    cdef Py_ssize_t row
    try:
        row = prev_index.__index__()
    except AttributeError:
        raise TypeError(
            f"prev_req_id_to_index[{req_id!r}] must be an int, "
            f"got {type(prev_index).__name__}"
        ) from None
    except OverflowError:
        raise IndexError(
            f"prev_req_id_to_index[{req_id!r}] = {prev_index} is out of range"
        ) from None
    if row < 0:
        raise IndexError(f"prev_req_id_to_index[{req_id!r}] = {row} is negative")
    return row


cdef Py_ssize_t _plan(list req_ids, dict prev_req_id_to_index,
                      list output_token_ids, PlannedUpdate* plans) except -1:
    """Pass 1: fill ``plans`` with the requests whose placeholders need ids.

    Mutates nothing and reads no sampled value.  Returns the number of plans.
    """
    cdef Py_ssize_t index, position, row, size
    cdef Py_ssize_t count = 0
    cdef PyObject* prev_index
    cdef PyObject* token_ids
    for index in range(PyList_GET_SIZE(req_ids)):
        req_id = <object>PyList_GET_ITEM(req_ids, index)
        prev_index = PyDict_GetItemWithError(prev_req_id_to_index, req_id)
        if prev_index == NULL or prev_index == Py_None:
            continue
        token_ids = PyList_GET_ITEM(output_token_ids, index)
        if token_ids == Py_None:
            continue  # a hole left by remove_request(): vLLM skips it too
        if not PyList_Check(token_ids):
            raise TypeError(
                f"output_token_ids[{index}] must be a list of ints or None, "
                f"got {type(<object>token_ids).__name__}"
            )
        size = PyList_GET_SIZE(<object>token_ids)
        if size == 0 or not _is_placeholder(
                PyList_GET_ITEM(<object>token_ids, size - 1), index, size - 1):
            continue  # no placeholder: tokens were discarded (KV-load failure)
        position = size - 1
        while position > 0 and _is_placeholder(
                PyList_GET_ITEM(<object>token_ids, position - 1), index,
                position - 1):
            position -= 1
        row = _as_row(req_id, <object>prev_index)
        plans[count].index = index
        plans[count].row = row
        plans[count].first_placeholder = position
        plans[count].list_size = size
        count += 1
    return count


cdef int _sampled_width_bits(object view) except -1:
    """64 or 32 for a 2-D native signed-integer buffer, else TypeError."""
    fmt = view.format.lstrip("@=")
    if view.ndim == 2 and fmt in ("q", "l", "i") and view.itemsize in (4, 8):
        return view.itemsize * 8
    raise TypeError(
        "sampled_token_ids must be a 2-D int32 or int64 array, got a "
        f"{view.ndim}-D array of format {view.format!r}"
    )


cdef object _sampled_view(object sampled_token_ids):
    """A ``memoryview`` of the sampled ids, sharing their memory.

    Anything with the buffer protocol (numpy arrays, ...) is used as is; a
    torch CPU tensor is viewed through ``.numpy()``, which shares its storage.
    """
    if PyObject_CheckBuffer(sampled_token_ids):
        return memoryview(sampled_token_ids)
    to_numpy = getattr(sampled_token_ids, "numpy", None)
    if to_numpy is None:
        raise TypeError(
            "sampled_token_ids must be a 2-D int32 or int64 array or CPU "
            f"tensor, got {type(sampled_token_ids).__name__}"
        )
    return memoryview(to_numpy())


cdef inline Py_ssize_t _num_sampled64(const int64_t[:, :] ids, Py_ssize_t row,
                                      Py_ssize_t width) noexcept:
    """vLLM's count over ``ids[row, :width]``: ``width``, or the first -1 if
    the row ends in -1."""
    cdef Py_ssize_t col
    if ids[row, width - 1] != -1:
        return width
    for col in range(width):
        if ids[row, col] == -1:
            return col
    return width  # not reached: the last column is -1


cdef inline Py_ssize_t _num_sampled32(const int32_t[:, :] ids, Py_ssize_t row,
                                      Py_ssize_t width) noexcept:
    """int32 twin of ``_num_sampled64``."""
    cdef Py_ssize_t col
    if ids[row, width - 1] != -1:
        return width
    for col in range(width):
        if ids[row, col] == -1:
            return col
    return width


cdef Py_ssize_t _apply(list output_token_ids, PlannedUpdate* plans,
                       Py_ssize_t count, const int64_t[:, :] ids64,
                       const int32_t[:, :] ids32,
                       Py_ssize_t* row_widths) except -1:
    """Pass 2: write the sampled ids over the placeholders, drop the surplus.

    Exactly one of ``ids64`` / ``ids32`` is bound.  ``row_widths`` starts as
    the full width of every row; like vLLM's ``del new_ids[n:]`` on its
    ``tolist()`` copy, using a row truncates it for any later request that
    maps to the same row.  Returns the number of requests updated.
    """
    global _requests_updated, _tokens_written, _placeholders_dropped
    cdef bint is_int64 = ids64 is not None
    cdef Py_ssize_t p, col, row, width, start, num_placeholders, num_to_write
    cdef Py_ssize_t updated = 0
    cdef PyObject* token_ids
    for p in range(count):
        row = plans[p].row
        width = row_widths[row]
        if width == 0:
            continue  # an empty row: vLLM skips the request
        if plans[p].index >= PyList_GET_SIZE(output_token_ids):
            _raise_changed(plans[p].index)
        token_ids = PyList_GET_ITEM(output_token_ids, plans[p].index)
        if (not PyList_Check(token_ids)
                or PyList_GET_SIZE(<object>token_ids) != plans[p].list_size):
            _raise_changed(plans[p].index)
        start = plans[p].first_placeholder
        num_placeholders = plans[p].list_size - start
        if is_int64:
            num_to_write = _num_sampled64(ids64, row, width)
        else:
            num_to_write = _num_sampled32(ids32, row, width)
        if num_to_write > num_placeholders:
            num_to_write = num_placeholders
        row_widths[row] = num_to_write
        for col in range(num_to_write):
            new_id = PyLong_FromLongLong(ids64[row, col] if is_int64
                                         else ids32[row, col])
            Py_INCREF(new_id)  # PyList_SetItem steals one reference
            PyList_SetItem(<object>token_ids, start + col, new_id)
        if num_to_write < num_placeholders:
            PyList_SetSlice(<object>token_ids, start + num_to_write,
                            plans[p].list_size, NULL)
            _placeholders_dropped += num_placeholders - num_to_write
        updated += 1
        _tokens_written += num_to_write
    _requests_updated += updated
    return updated


cdef int _raise_changed(Py_ssize_t index) except -1:
    # Only reachable if the synchronize callback itself changed the batch.
    raise RuntimeError(
        f"output_token_ids[{index}] changed while waiting for the sampled ids"
    )


def update_async_output_token_ids(list req_ids not None,
                                  dict prev_req_id_to_index not None,
                                  list output_token_ids not None,
                                  sampled_token_ids,
                                  copy_ready=None):
    """Replace every request's trailing ``-1`` placeholders with its sampled ids.

    The batch-wide equivalent of vLLM's
    ``InputBatch.update_async_output_token_ids`` (0.22 and later): see
    ``fastbatch._reference.update_async_output_token_ids`` for the rules in
    plain Python and the README for the input contract.  Returns the number of
    requests whose output list was updated.
    """
    global _calls, _syncs
    cdef Py_ssize_t num_reqs = PyList_GET_SIZE(req_ids)
    cdef Py_ssize_t count, p, row, num_rows, width
    cdef PlannedUpdate* plans = NULL
    cdef Py_ssize_t* row_widths = NULL
    cdef const int64_t[:, :] ids64 = None
    cdef const int32_t[:, :] ids32 = None
    if PyList_GET_SIZE(output_token_ids) != num_reqs:
        raise IndexError(
            f"output_token_ids has {PyList_GET_SIZE(output_token_ids)} entries "
            f"but req_ids has {num_reqs}"
        )
    synchronize = _resolve_sync(copy_ready)
    _calls += 1
    if num_reqs == 0:
        return 0
    plans = <PlannedUpdate*>PyMem_Malloc(num_reqs * sizeof(PlannedUpdate))
    if plans == NULL:
        raise MemoryError()
    try:
        count = _plan(req_ids, prev_req_id_to_index, output_token_ids, plans)
        if count == 0:
            return 0  # vLLM neither synchronises nor reads the sampled ids
        view = _sampled_view(sampled_token_ids)
        if _sampled_width_bits(view) == 64:
            ids64 = view
            num_rows, width = ids64.shape[0], ids64.shape[1]
        else:
            ids32 = view
            num_rows, width = ids32.shape[0], ids32.shape[1]
        for p in range(count):
            if plans[p].row >= num_rows:
                raise IndexError(
                    f"prev_req_id_to_index[{req_ids[plans[p].index]!r}] = "
                    f"{plans[p].row} is out of range for {num_rows} sampled rows"
                )
        row_widths = <Py_ssize_t*>PyMem_Malloc(num_rows * sizeof(Py_ssize_t))
        if row_widths == NULL:
            raise MemoryError()
        for row in range(num_rows):
            row_widths[row] = width
        if synchronize is not None:
            synchronize()
            _syncs += 1
        return _apply(output_token_ids, plans, count, ids64, ids32, row_widths)
    finally:
        PyMem_Free(row_widths)
        PyMem_Free(plans)


cdef object _resolve_sync(object copy_ready):
    """The zero-argument callable that waits for the sampled ids, or None."""
    if copy_ready is None:
        return None
    synchronize = getattr(copy_ready, "synchronize", None)
    if synchronize is not None:
        return synchronize
    if callable(copy_ready):
        return copy_ready
    raise TypeError(
        "copy_ready must be None, an event with .synchronize() or a callable, "
        f"got {type(copy_ready).__name__}"
    )
