# Compiler directives are set in setup.py (one place, with a debug switch).
"""Compiled piece ``async_output_token_ids``: vLLM's ``InputBatch.update_async_output_token_ids``.

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
   one list store: no list is allocated.

Both passes go over the batch in blocks of requests and prefetch each block's
request ids, list objects, list tails and ints in stages before working on it
(group prefetching), so that after a forward pass has evicted them the cache
misses of a block overlap instead of coming one after another.

The sampled ids are read through a plain pointer and byte strides
(``SampledIds``, shared with the rows-to-lists pieces in ``_common``), taken
from the buffer protocol (numpy arrays, ...) or from a torch CPU tensor's
``data_ptr()``/``stride()``: zero-copy either way.  Typed
memoryviews were measured first; acquiring one (after ``tensor.numpy()``)
cost about 1 us per call, which made a one-request step slower than vLLM's own
loop.
"""

__all__ = ["update_async_output_token_ids"]

from cpython.buffer cimport PyBuffer_Release
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE, PyList_New
from cpython.mem cimport PyMem_Free, PyMem_Realloc
from cpython.object cimport PyObject
from libc.stdint cimport int32_t, int64_t, uint64_t

from fastbatch._kernels._common cimport (
    MAX_INLINE_TAIL,
    TOKEN_CACHE_SIZE,
    PyDict_GetItemWithError,
    PyLong_AsLongLongAndOverflow,
    PyLong_Check,
    PyLong_CheckExact,
    PyList_Check,
    PyList_CheckExact,
    PyList_SetSlice,
    Py_DECREF,
    Py_None,
    Py_SET_SIZE,
    SampledIds,
    Py_SIZE,
    PySequence_Fast_ITEMS,
    as_row,
    id_at,
    list_set_item,
    long_is_minus_one,
    sampled_t,
    token_object,
    token_table,
    view_ids,
)
from fastbatch._kernels._prefetch cimport prefetch_read, prefetch_write

ctypedef struct PlannedUpdate:
    Py_ssize_t index              # position in the batch (req_ids, output lists)
    Py_ssize_t row                # row of the sampled ids (vLLM's prev_index)
    Py_ssize_t first_placeholder  # start of the trailing run of -1
    Py_ssize_t list_size          # length of the output list when planned


# vLLM's placeholders are the literal -1: CPython's cached small int, so a
# pointer comparison settles nearly every item; other ints are compared by value.
cdef object MINUS_ONE = -1

cdef enum:
    # Requests whose cache misses are overlapped (group prefetching): enough
    # misses in flight to cover the memory latency, few enough that what a
    # stage fetched is still cached when the next stage reads it.
    PREFETCH_BLOCK = 16

# Process-wide counters, read with stats(): they let a test, or a user, prove
# that the fast path really ran and really replaced placeholders.
cdef uint64_t _calls = 0
cdef uint64_t _syncs = 0
cdef uint64_t _requests_updated = 0
cdef uint64_t _tokens_written = 0
cdef uint64_t _placeholders_dropped = 0


def stats():
    """This piece's counters since import or the last ``reset_stats()``."""
    return {
        "calls": _calls,
        "syncs": _syncs,
        "requests_updated": _requests_updated,
        "tokens_written": _tokens_written,
        "placeholders_dropped": _placeholders_dropped,
    }


def reset_stats():
    """Set every counter of ``stats()`` back to zero."""
    global _calls, _syncs, _requests_updated, _tokens_written, _placeholders_dropped
    _calls = _syncs = _requests_updated = _tokens_written = _placeholders_dropped = 0


cdef inline bint _is_placeholder(PyObject* item, Py_ssize_t request,
                                 Py_ssize_t position) except -1:
    """True if ``item`` is the int -1, False for another int, else TypeError."""
    if item == <PyObject*>MINUS_ONE:
        return True
    if PyLong_CheckExact(item):
        return long_is_minus_one(item)
    return _is_placeholder_slow(item, request, position)


cdef bint _is_placeholder_slow(PyObject* item, Py_ssize_t request,
                               Py_ssize_t position) except -1:
    cdef int overflow = 0
    if not PyLong_Check(item):
        raise TypeError(
            f"output_token_ids[{request}][{position}] must be an int, "
            f"got {type(<object>item).__name__}"
        )
    return PyLong_AsLongLongAndOverflow(item, &overflow) == -1 and overflow == 0


cdef inline PyObject** _list_items(PyObject* token_ids, Py_ssize_t* size) noexcept:
    """The item array and size of ``token_ids`` if it is a non-empty list, else NULL."""
    if not PyList_CheckExact(token_ids):
        return NULL
    size[0] = Py_SIZE(token_ids)
    return PySequence_Fast_ITEMS(token_ids) if size[0] > 0 else NULL


cdef void _prefetch_plan(list req_ids, list output_token_ids, int stage,
                         Py_ssize_t start, Py_ssize_t end) noexcept:
    """One stage of ``_plan``'s group prefetching, over requests [start, end).

    After a forward pass, a request's id string, list object, list tail and
    last history int each come from memory; taken one request after another
    that is four misses in a row per request.  Instead, ``_plan`` runs these
    stages as a pipeline over blocks of requests, each block one stage ahead
    of the next, so that every stage reads what the stage before fetched one
    block earlier, and a block's misses overlap: stage 0, the id strings (the
    dict lookup reads their cached hash) and list objects; stage 1, each
    list's last slots; stage 2, the int before the trailing -1s (the reverse
    scan reads its value).  Hints only: nothing read here decides anything
    (Python code run by the work in between, a key's ``__eq__`` say, can only
    make a hint useless).
    """
    cdef Py_ssize_t index, size = 0, position, stop
    cdef PyObject** items
    end = min(end, PyList_GET_SIZE(req_ids), PyList_GET_SIZE(output_token_ids))
    for index in range(start, end):
        if stage == 0:
            prefetch_read(PyList_GET_ITEM(req_ids, index))
            prefetch_read(PyList_GET_ITEM(output_token_ids, index))
            continue
        items = _list_items(PyList_GET_ITEM(output_token_ids, index), &size)
        if items == NULL:
            continue
        if stage == 1:
            prefetch_read(&items[size - 1])
            prefetch_read(&items[size - 2 if size > 1 else 0])
            continue
        position = size - 1
        stop = size - 1 - MAX_INLINE_TAIL if size > 1 + MAX_INLINE_TAIL else 0
        while position > stop and items[position] == <PyObject*>MINUS_ONE:
            position -= 1
        if items[position] != <PyObject*>MINUS_ONE:
            prefetch_read(items[position])


cdef Py_ssize_t _plan(list req_ids, dict prev_req_id_to_index,
                      list output_token_ids, PlannedUpdate* plans) except -1:
    """Pass 1: fill ``plans`` with the requests whose placeholders need ids.

    Mutates nothing and reads no sampled value.  Returns the number of plans.
    Works in blocks of PREFETCH_BLOCK requests, prefetched by a pipeline of
    stages (``_prefetch_plan``).
    """
    cdef Py_ssize_t index, position, size
    cdef Py_ssize_t count = 0
    cdef PyObject* req_id
    cdef PyObject* prev_index
    cdef PyObject* token_ids
    for index in range(PyList_GET_SIZE(req_ids)):
        if index % PREFETCH_BLOCK == 0:
            if index == 0:  # fill the pipeline
                _prefetch_plan(req_ids, output_token_ids, 0, 0, 3 * PREFETCH_BLOCK)
                _prefetch_plan(req_ids, output_token_ids, 1, 0, 2 * PREFETCH_BLOCK)
                _prefetch_plan(req_ids, output_token_ids, 2, 0, PREFETCH_BLOCK)
            else:
                _prefetch_plan(req_ids, output_token_ids, 0, index + 2 * PREFETCH_BLOCK,
                               index + 3 * PREFETCH_BLOCK)
                _prefetch_plan(req_ids, output_token_ids, 1, index + PREFETCH_BLOCK,
                               index + 2 * PREFETCH_BLOCK)
                _prefetch_plan(req_ids, output_token_ids, 2, index, index + PREFETCH_BLOCK)
        req_id = PyList_GET_ITEM(req_ids, index)
        prev_index = PyDict_GetItemWithError(<PyObject*>prev_req_id_to_index, req_id)
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
        plans[count].index = index
        plans[count].row = as_row(req_id, prev_index)
        plans[count].first_placeholder = position
        plans[count].list_size = size
        count += 1
    return count


cdef inline Py_ssize_t _num_sampled(const SampledIds* ids, Py_ssize_t row,
                                    Py_ssize_t width, const sampled_t* dtype) noexcept nogil:
    """vLLM's count over the row's first ``width`` ids: ``width``, or the index
    of the first -1 if they end in -1."""
    cdef Py_ssize_t col
    if id_at(ids, row, width - 1, dtype) != -1:
        return width
    for col in range(width):
        if id_at(ids, row, col, dtype) == -1:
            return col
    return width  # not reached: the last id is -1


cdef inline int _replace_tail(PyObject* token_ids, Py_ssize_t start, Py_ssize_t size,
                              Py_ssize_t num_to_write, const SampledIds* ids,
                              Py_ssize_t row, const sampled_t* dtype,
                              PyObject** table) except -1:
    """``token_ids[start:] = <the row's first num_to_write ids>``, as vLLM does it.

    Like CPython's slice assignment, the list reaches its final state before
    any replaced placeholder is released (releasing one may run Python code).
    Up to MAX_INLINE_TAIL placeholders this is done in place: the replaced
    items set aside on the stack, the ids stored, the size cut (keeping the
    allocation: vLLM appends again next step).  Longer tails take the general
    ``PyList_SetSlice``.
    """
    cdef PyObject* replaced[MAX_INLINE_TAIL]
    cdef PyObject* token
    cdef Py_ssize_t i, col, count = size - start
    if count > MAX_INLINE_TAIL:
        return _replace_tail_general(token_ids, start, size, num_to_write, ids, row,
                                     dtype, table)
    for col in range(num_to_write):
        token = token_object(table, id_at(ids, row, col, dtype))
        if token == NULL:  # the slots written so far hold new ids: release theirs
            for i in range(col):
                Py_DECREF(replaced[i])
            return -1
        replaced[col] = PyList_GET_ITEM(<object>token_ids, start + col)
        list_set_item(token_ids, start + col, token)
    for i in range(num_to_write, count):
        replaced[i] = PyList_GET_ITEM(<object>token_ids, start + i)
    Py_SET_SIZE(token_ids, start + num_to_write)
    for i in range(count):
        Py_DECREF(replaced[i])
    return 0


cdef int _replace_tail_general(PyObject* token_ids, Py_ssize_t start, Py_ssize_t size,
                               Py_ssize_t num_to_write, const SampledIds* ids,
                               Py_ssize_t row, const sampled_t* dtype,
                               PyObject** table) except -1:
    """``_replace_tail`` through a new list and ``PyList_SetSlice``."""
    cdef list new_ids = PyList_New(num_to_write)
    cdef PyObject* token
    cdef Py_ssize_t col
    for col in range(num_to_write):
        token = token_object(table, id_at(ids, row, col, dtype))
        if token == NULL:
            return -1  # new_ids, freed, skips its unfilled slots
        list_set_item(<PyObject*>new_ids, col, token)
    return PyList_SetSlice(token_ids, start, size, <PyObject*>new_ids)


cdef void _prefetch_apply(list output_token_ids, const PlannedUpdate* plans,
                          Py_ssize_t start, Py_ssize_t end, const SampledIds* ids,
                          const Py_ssize_t* row_widths, const sampled_t* dtype,
                          PyObject** table) noexcept:
    """Group prefetching for ``_apply`` over plans [start, end): the list
    objects; then the slot each list's first sampled id goes to, and that
    id's entry in the shared token table; then the shared int itself (its
    reference count is written).  Hints only, as in ``_prefetch_plan``."""
    cdef Py_ssize_t p, size = 0, num_lists = PyList_GET_SIZE(output_token_ids)
    cdef PyObject** items
    cdef sampled_t value
    for p in range(start, end):
        if plans[p].index < num_lists:
            prefetch_read(PyList_GET_ITEM(output_token_ids, plans[p].index))
    for p in range(start, end):
        if plans[p].index < num_lists:
            items = _list_items(PyList_GET_ITEM(output_token_ids, plans[p].index), &size)
            if items != NULL and plans[p].first_placeholder < size:
                prefetch_write(&items[plans[p].first_placeholder])
        if table != NULL and row_widths[plans[p].row] > 0:
            value = id_at(ids, plans[p].row, 0, dtype)
            if 0 <= value < TOKEN_CACHE_SIZE:
                prefetch_read(&table[value])
    if table == NULL:
        return
    for p in range(start, end):
        if row_widths[plans[p].row] > 0:
            value = id_at(ids, plans[p].row, 0, dtype)
            if 0 <= value < TOKEN_CACHE_SIZE and table[value] != NULL:
                prefetch_write(table[value])


cdef Py_ssize_t _apply(list output_token_ids, PlannedUpdate* plans,
                       Py_ssize_t count, const SampledIds* ids,
                       Py_ssize_t* row_widths, const sampled_t* dtype) except -1:
    """Pass 2: write the sampled ids over the placeholders, drop the surplus.

    ``row_widths`` starts as the full width of every row; like vLLM's
    ``del new_ids[n:]`` on its ``tolist()`` copy, using a row truncates it for
    any later request mapped to the same row.  Returns the requests updated.
    """
    global _requests_updated, _tokens_written, _placeholders_dropped
    cdef PyObject** table = token_table()
    cdef Py_ssize_t p, row, width, start, num_placeholders, num_to_write
    cdef Py_ssize_t updated = 0, written = 0, dropped = 0
    cdef PyObject* token_ids
    cdef PyObject* replaced
    cdef PyObject* token
    for p in range(count):
        if p % PREFETCH_BLOCK == 0:
            _prefetch_apply(output_token_ids, plans, p, min(p + PREFETCH_BLOCK, count), ids,
                            row_widths, dtype, table)
        row = plans[p].row
        width = row_widths[row]
        if width == 0:
            continue  # an empty row: vLLM skips the request
        token_ids = NULL
        if plans[p].index < PyList_GET_SIZE(output_token_ids):
            token_ids = PyList_GET_ITEM(output_token_ids, plans[p].index)
        if (token_ids == NULL or not PyList_Check(token_ids)
                or PyList_GET_SIZE(<object>token_ids) != plans[p].list_size):
            # Only Python code run by the synchronize callback, or by a
            # released placeholder, can have changed the batch.
            raise RuntimeError(
                f"output_token_ids[{plans[p].index}] changed while waiting "
                "for the sampled ids"
            )
        start = plans[p].first_placeholder
        num_placeholders = plans[p].list_size - start
        num_to_write = _num_sampled(ids, row, width, dtype)
        if num_to_write > num_placeholders:
            num_to_write = num_placeholders
        row_widths[row] = num_to_write
        if num_placeholders == 1 and num_to_write == 1:  # plain decode: one store
            replaced = PyList_GET_ITEM(<object>token_ids, start)
            token = token_object(table, id_at(ids, row, 0, dtype))
            if token == NULL:
                return -1
            list_set_item(token_ids, start, token)
            Py_DECREF(replaced)
        else:
            _replace_tail(token_ids, start, plans[p].list_size, num_to_write, ids, row,
                          dtype, table)
        dropped += num_placeholders - num_to_write
        updated += 1
        written += num_to_write
    _requests_updated += updated
    _tokens_written += written
    _placeholders_dropped += dropped
    return updated


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


ctypedef struct Scratch:
    PlannedUpdate* plans
    Py_ssize_t plans_capacity
    Py_ssize_t* row_widths
    Py_ssize_t row_widths_capacity


# Working memory kept between calls: a fresh malloc of a big batch's plans
# (128 KiB at 4096 requests) is served by mmap, page faults and all, every
# step.  A call re-entered from the synchronize callback uses its own.
cdef Scratch _scratch = Scratch(NULL, 0, NULL, 0)
cdef bint _scratch_in_use = False


cdef int _reserve(Scratch* scratch, Py_ssize_t num_plans,
                  Py_ssize_t num_rows) except -1:
    """Grow the scratch buffers to hold ``num_plans`` plans, ``num_rows`` rows."""
    cdef void* grown
    if num_plans > scratch.plans_capacity:
        grown = PyMem_Realloc(scratch.plans, num_plans * sizeof(PlannedUpdate))
        if grown == NULL:
            raise MemoryError()
        scratch.plans, scratch.plans_capacity = <PlannedUpdate*>grown, num_plans
    if num_rows > scratch.row_widths_capacity:
        grown = PyMem_Realloc(scratch.row_widths, num_rows * sizeof(Py_ssize_t))
        if grown == NULL:
            raise MemoryError()
        scratch.row_widths = <Py_ssize_t*>grown
        scratch.row_widths_capacity = num_rows
    return 0


def update_async_output_token_ids(list req_ids not None,
                                  dict prev_req_id_to_index not None,
                                  list output_token_ids not None,
                                  sampled_token_ids,
                                  copy_ready=None):
    """Replace every request's trailing ``-1`` placeholders with its sampled ids.

    The batch-wide equivalent of vLLM's
    ``InputBatch.update_async_output_token_ids`` (vLLM 0.22.0 to 0.33.0).
    Returns the number of requests whose output list was updated.
    """
    global _calls, _syncs, _scratch_in_use
    cdef Py_ssize_t num_reqs = PyList_GET_SIZE(req_ids)
    if PyList_GET_SIZE(output_token_ids) != num_reqs:
        raise IndexError(
            f"output_token_ids has {PyList_GET_SIZE(output_token_ids)} entries "
            f"but req_ids has {num_reqs}"
        )
    synchronize = _resolve_sync(copy_ready)
    _calls += 1
    if num_reqs == 0:
        return 0
    cdef Scratch own = Scratch(NULL, 0, NULL, 0)
    if _scratch_in_use:
        return _update(req_ids, prev_req_id_to_index, output_token_ids,
                       sampled_token_ids, synchronize, &own)
    _scratch_in_use = True
    try:
        return _update(req_ids, prev_req_id_to_index, output_token_ids,
                       sampled_token_ids, synchronize, &_scratch)
    finally:
        _scratch_in_use = False
        PyMem_Free(own.plans)
        PyMem_Free(own.row_widths)


cdef Py_ssize_t _update(list req_ids, dict prev_req_id_to_index,
                        list output_token_ids, object sampled_token_ids,
                        object synchronize, Scratch* scratch) except -1:
    """Plan, check the sampled ids, synchronise, apply; see the module doc."""
    global _syncs
    cdef Py_ssize_t count, p, row
    cdef SampledIds ids
    cdef Py_buffer buffer
    cdef bint have_buffer = False
    _reserve(scratch, PyList_GET_SIZE(req_ids), 0)
    count = _plan(req_ids, prev_req_id_to_index, output_token_ids, scratch.plans)
    if count == 0:
        return 0  # vLLM neither synchronises nor reads the sampled ids
    view_ids(sampled_token_ids, &ids, &buffer, &have_buffer, "sampled_token_ids")
    try:
        for p in range(count):
            if scratch.plans[p].row >= ids.num_rows:
                raise IndexError(
                    f"prev_req_id_to_index[{req_ids[scratch.plans[p].index]!r}] = "
                    f"{scratch.plans[p].row} is out of range for {ids.num_rows} "
                    "sampled rows"
                )
        _reserve(scratch, 0, ids.num_rows)
        for row in range(ids.num_rows):
            scratch.row_widths[row] = ids.width
        if synchronize is not None:
            synchronize()
            _syncs += 1
        if ids.is_int64:
            return _apply(output_token_ids, scratch.plans, count, &ids,
                          scratch.row_widths, <const int64_t*>NULL)
        return _apply(output_token_ids, scratch.plans, count, &ids,
                      scratch.row_widths, <const int32_t*>NULL)
    finally:
        if have_buffer:
            PyBuffer_Release(&buffer)
