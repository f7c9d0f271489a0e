# Compiler directives are set in setup.py (one place, with a debug switch).
"""Compiled kernel: vLLM's per-step token bookkeeping, one call per step.

Three batch-wide functions, each the compiled twin of a per-request Python
loop of vLLM's V1 runner (``fastbatch._reference`` has all three in plain
Python; the tests hold the two, and vLLM, to each other):

* ``update_async_output_token_ids``: ``InputBatch.update_async_output_token_ids``.
* ``update_async_spec_token_ids``: ``InputBatch.update_async_spec_token_ids``.
* ``output_tokens_tensor``: the padded output-token tensor of the penalties
  (``vllm/v1/sample/ops/penalties.py``: ``_convert_to_tensors`` followed by
  ``apply_all_penalties``' ``-1 -> vocab_size`` masking).

The rest of this note is about the first.

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

The sampled ids are read through a plain pointer and byte strides
(``SampledIds``), taken from the buffer protocol (numpy arrays, ...) or from a
torch CPU tensor's ``data_ptr()``/``stride()``: zero-copy either way.  Typed
memoryviews were measured first; acquiring one (after ``tensor.numpy()``)
cost about 1 us per call, which made a one-request step slower than vLLM's own
loop.
"""

from cpython.buffer cimport (
    PyBUF_RECORDS,
    PyBUF_RECORDS_RO,
    PyBuffer_IsContiguous,
    PyBuffer_Release,
    PyObject_GetBuffer,
)
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE, PyList_New
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.object cimport PyObject
from libc.stdint cimport int32_t, int64_t, uint64_t, uintptr_t
from libc.string cimport memcpy

import sys

cdef extern from "Python.h":
    # Borrowed-pointer forms: Cython's bundled declarations take ``object``
    # arguments, which would add reference-count traffic to the hot loops.
    PyObject* PyDict_GetItemWithError(PyObject* mp, PyObject* key) except? NULL
    bint PyList_Check(PyObject* o)
    bint PyList_CheckExact(PyObject* o)
    bint PyTuple_Check(PyObject* o)
    PyObject** PySequence_Fast_ITEMS(PyObject* o)
    Py_ssize_t Py_SIZE(PyObject* o)
    bint PyLong_Check(PyObject* o)
    bint PyLong_CheckExact(PyObject* o)
    bint PyObject_CheckBuffer(object o)
    long long PyLong_AsLongLongAndOverflow(PyObject* o, int* overflow) except? -1
    PyObject* new_int "PyLong_FromLongLong"(long long value)
    void list_set_item "PyList_SET_ITEM"(PyObject* lst, Py_ssize_t i, PyObject* item)
    void Py_DECREF(PyObject* o)
    void Py_INCREF(PyObject* o)
    void Py_XDECREF(PyObject* o)
    void* PyMem_RawCalloc(size_t nelem, size_t elsize)
    PyObject* Py_None
    void Py_SET_SIZE(PyObject* o, Py_ssize_t size)
    # itemlist NULL deletes the slice (no list is allocated).
    int PyList_SetSlice(PyObject* lst, Py_ssize_t low, Py_ssize_t high,
                        PyObject* itemlist) except -1


cdef extern from "_pylong.h":
    bint long_is_minus_one "fastbatch_long_is_minus_one"(PyObject* o) noexcept
    Py_ssize_t long_as_small_index "fastbatch_long_as_small_index"(PyObject* o) noexcept
    bint long_as_compact "fastbatch_long_as_compact"(PyObject* o,
                                                     long long* value) noexcept


ctypedef fused sampled_t:
    int32_t
    int64_t


ctypedef struct PlannedUpdate:
    Py_ssize_t index              # position in the batch (req_ids, output lists)
    Py_ssize_t row                # row of the sampled ids (vLLM's prev_index)
    Py_ssize_t first_placeholder  # start of the trailing run of -1
    Py_ssize_t list_size          # length of the output list when planned


ctypedef struct SampledIds:
    const char* data
    Py_ssize_t num_rows
    Py_ssize_t width
    Py_ssize_t row_stride         # in bytes
    Py_ssize_t col_stride         # in bytes
    bint is_int64


# vLLM's placeholders are the literal -1: CPython's cached small int, so a
# pointer comparison settles nearly every item; other ints are compared by value.
cdef object MINUS_ONE = -1
cdef bint LITTLE_ENDIAN = sys.byteorder == "little"
cdef object TORCH_INT32 = None    # torch.int32 and torch.int64, looked up
cdef object TORCH_INT64 = None    # once, when the first tensor comes

# Token ids below this are handed out as shared int objects (see _token_object).
cdef enum:
    TOKEN_CACHE_SIZE = 1 << 18
cdef PyObject** _token_cache = NULL

# Process-wide counters, read with stats(): they let a test, or a user, prove
# that the fast path really ran and really replaced placeholders.
cdef uint64_t _calls = 0
cdef uint64_t _syncs = 0
cdef uint64_t _requests_updated = 0
cdef uint64_t _tokens_written = 0
cdef uint64_t _placeholders_dropped = 0
cdef uint64_t _spec_calls = 0
cdef uint64_t _spec_requests_updated = 0
cdef uint64_t _penalty_tensors = 0
cdef uint64_t _penalty_tokens = 0


def stats():
    """Counters since import or the last ``reset_stats()``, as a dict.

    ``calls`` to ``tokens_written``/``placeholders_dropped`` count
    ``update_async_output_token_ids``; ``spec_*`` count
    ``update_async_spec_token_ids``; ``penalty_*`` count
    ``output_tokens_tensor`` (tensors built, token ids converted).
    """
    return {
        "calls": _calls,
        "syncs": _syncs,
        "requests_updated": _requests_updated,
        "tokens_written": _tokens_written,
        "placeholders_dropped": _placeholders_dropped,
        "spec_calls": _spec_calls,
        "spec_requests_updated": _spec_requests_updated,
        "penalty_tensors": _penalty_tensors,
        "penalty_tokens": _penalty_tokens,
    }


def reset_stats():
    """Set every counter of ``stats()`` back to zero."""
    global _calls, _syncs, _requests_updated, _tokens_written
    global _placeholders_dropped, _spec_calls, _spec_requests_updated
    global _penalty_tensors, _penalty_tokens
    _calls = _syncs = _requests_updated = _tokens_written = 0
    _placeholders_dropped = _spec_calls = _spec_requests_updated = 0
    _penalty_tensors = _penalty_tokens = 0


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


cdef inline Py_ssize_t _as_row(PyObject* req_id, PyObject* prev_index) except -1:
    """vLLM's ``prev_index`` as a row number: an int >= 0, else a clear error."""
    cdef Py_ssize_t row = -1
    if PyLong_CheckExact(prev_index):
        row = long_as_small_index(prev_index)
    return row if row >= 0 else _as_row_slow(req_id, prev_index)


cdef Py_ssize_t _as_row_slow(PyObject* req_id, PyObject* prev_index) except -1:
    """The general case of ``_as_row``, with the errors.

    (vLLM would wrap a negative index around; that is never what was meant.)
    """
    cdef Py_ssize_t row
    try:
        row = (<object>prev_index).__index__()
    except AttributeError:
        raise TypeError(
            f"prev_req_id_to_index[{<object>req_id!r}] must be an int, "
            f"got {type(<object>prev_index).__name__}"
        ) from None
    except OverflowError:
        raise IndexError(
            f"prev_req_id_to_index[{<object>req_id!r}] = {<object>prev_index} "
            "is out of range"
        ) from None
    if row < 0:
        raise IndexError(
            f"prev_req_id_to_index[{<object>req_id!r}] = {row} is negative")
    return row


cdef Py_ssize_t _plan(list req_ids, dict prev_req_id_to_index,
                      list output_token_ids, PlannedUpdate* plans) except -1:
    """Pass 1: fill ``plans`` with the requests whose placeholders need ids.

    Mutates nothing and reads no sampled value.  Returns the number of plans.
    """
    cdef Py_ssize_t index, position, size
    cdef Py_ssize_t count = 0
    cdef PyObject* req_id
    cdef PyObject* prev_index
    cdef PyObject* token_ids
    for index in range(PyList_GET_SIZE(req_ids)):
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
        plans[count].row = _as_row(req_id, prev_index)
        plans[count].first_placeholder = position
        plans[count].list_size = size
        count += 1
    return count


cdef int _view_buffer(const Py_buffer* buffer, SampledIds* ids) except -1:
    """Fill ``ids`` from an acquired buffer (the caller releases it)."""
    cdef const char* fmt = buffer.format
    if fmt[0] == b"@" or fmt[0] == b"=" or (fmt[0] == b"<" and LITTLE_ENDIAN):
        fmt += 1
    if (buffer.ndim != 2 or buffer.itemsize not in (4, 8)
            or fmt[0] not in (b"i", b"l", b"q") or fmt[1] != 0):
        raise TypeError(
            "sampled_token_ids must be a 2-D int32 or int64 array, got a "
            f"{buffer.ndim}-D array of format {buffer.format.decode()!r}"
        )
    ids.data = <const char*>buffer.buf
    ids.num_rows, ids.width = buffer.shape[0], buffer.shape[1]
    ids.row_stride, ids.col_stride = buffer.strides[0], buffer.strides[1]
    ids.is_int64 = buffer.itemsize == 8
    return 0


cdef int _view_tensor(object tensor, SampledIds* ids) except -1:
    """Fill ``ids`` from a torch CPU tensor, sharing its memory."""
    global TORCH_INT32, TORCH_INT64
    dtype = getattr(tensor, "dtype", None)
    if TORCH_INT64 is None and "torch" in sys.modules:
        TORCH_INT32, TORCH_INT64 = sys.modules["torch"].int32, sys.modules["torch"].int64
    if dtype is None:
        raise TypeError(
            "sampled_token_ids must be a 2-D int32 or int64 array or CPU "
            f"tensor, got {type(tensor).__name__}"
        )
    if dtype is not TORCH_INT64 and dtype is not TORCH_INT32:
        raise TypeError(
            f"sampled_token_ids must be int32 or int64, got {dtype}")
    if not tensor.is_cpu:
        raise TypeError(
            f"sampled_token_ids must be on the CPU, got {tensor.device}")
    try:  # sparse and other storage-less layouts have neither
        strides = tensor.stride()
        data = tensor.data_ptr()
    except RuntimeError:
        raise TypeError(
            f"sampled_token_ids must be a dense tensor, got {tensor.layout}"
        ) from None
    if len(strides) != 2:
        raise TypeError(
            f"sampled_token_ids must be 2-D, got a {len(strides)}-D tensor")
    shape = tensor.shape
    ids.is_int64 = dtype is TORCH_INT64
    itemsize = 8 if ids.is_int64 else 4
    ids.data = <const char*><size_t>data
    ids.num_rows, ids.width = shape[0], shape[1]
    ids.row_stride, ids.col_stride = strides[0] * itemsize, strides[1] * itemsize
    return 0


cdef inline sampled_t _id_at(const SampledIds* ids, Py_ssize_t row, Py_ssize_t col,
                             const sampled_t* dtype) noexcept nogil:
    """The sampled id at (row, col); ``dtype`` only selects the fused type."""
    cdef sampled_t value = 0
    # memcpy: no alignment assumption; compilers emit a single load.
    memcpy(&value, ids.data + row * ids.row_stride + col * ids.col_stride,
           sizeof(sampled_t))
    return value


cdef inline Py_ssize_t _num_sampled(const SampledIds* ids, Py_ssize_t row,
                                    Py_ssize_t width, const sampled_t* dtype) noexcept nogil:
    """vLLM's count over the row's first ``width`` ids: ``width``, or the index
    of the first -1 if they end in -1."""
    cdef Py_ssize_t col
    if _id_at(ids, row, width - 1, dtype) != -1:
        return width
    for col in range(width):
        if _id_at(ids, row, col, dtype) == -1:
            return col
    return width  # not reached: the last id is -1


cdef inline PyObject* _token_object(int64_t value) noexcept:
    """A new reference to the int ``value`` (NULL, with MemoryError set, on failure).

    Token ids in [0, 2**18) (every common vocabulary) come from a table of
    shared int objects, filled on first use, as CPython does for -5..256: no
    allocation per token, and long outputs share objects instead of holding
    one 28-byte int per token.  Ints are immutable, so sharing them is
    invisible to vLLM (equal values, as its own ``tolist()`` gives).
    """
    global _token_cache
    cdef PyObject* token
    if value < 0 or value >= TOKEN_CACHE_SIZE:
        return new_int(value)
    if _token_cache == NULL:
        _token_cache = <PyObject**>PyMem_RawCalloc(TOKEN_CACHE_SIZE, sizeof(PyObject*))
        if _token_cache == NULL:
            return new_int(value)
    token = _token_cache[value]
    if token == NULL:
        token = new_int(value)
        if token == NULL:
            return NULL
        _token_cache[value] = token  # the table keeps this reference
    Py_INCREF(token)
    return token


cdef enum:
    MAX_INLINE_TAIL = 16  # placeholders replaced without allocating a list


cdef inline int _replace_tail(PyObject* token_ids, Py_ssize_t start, Py_ssize_t size,
                              Py_ssize_t num_to_write, const SampledIds* ids,
                              Py_ssize_t row, const sampled_t* dtype) except -1:
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
                                     dtype)
    for col in range(num_to_write):
        token = _token_object(_id_at(ids, row, col, dtype))
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
                               Py_ssize_t row, const sampled_t* dtype) except -1:
    """``_replace_tail`` through a new list and ``PyList_SetSlice``."""
    cdef list new_ids = PyList_New(num_to_write)
    cdef PyObject* token
    cdef Py_ssize_t col
    for col in range(num_to_write):
        token = _token_object(_id_at(ids, row, col, dtype))
        if token == NULL:
            return -1  # new_ids, freed, skips its unfilled slots
        list_set_item(<PyObject*>new_ids, col, token)
    return PyList_SetSlice(token_ids, start, size, <PyObject*>new_ids)


cdef Py_ssize_t _apply(list output_token_ids, PlannedUpdate* plans,
                       Py_ssize_t count, const SampledIds* ids,
                       Py_ssize_t* row_widths, const sampled_t* dtype) except -1:
    """Pass 2: write the sampled ids over the placeholders, drop the surplus.

    ``row_widths`` starts as the full width of every row; like vLLM's
    ``del new_ids[n:]`` on its ``tolist()`` copy, using a row truncates it for
    any later request mapped to the same row.  Returns the requests updated.
    """
    global _requests_updated, _tokens_written, _placeholders_dropped
    cdef Py_ssize_t p, row, width, start, num_placeholders, num_to_write
    cdef Py_ssize_t updated = 0, written = 0, dropped = 0
    cdef PyObject* token_ids
    cdef PyObject* replaced
    cdef PyObject* token
    for p in range(count):
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
            token = _token_object(_id_at(ids, row, 0, dtype))
            if token == NULL:
                return -1
            list_set_item(token_ids, start, token)
            Py_DECREF(replaced)
        else:
            _replace_tail(token_ids, start, plans[p].list_size, num_to_write, ids, row,
                          dtype)
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
    ``InputBatch.update_async_output_token_ids`` (0.22 and later): see
    ``fastbatch._reference`` for the rules in plain Python and the README for
    the input contract.  Returns the number of requests whose list was updated.
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
    if PyObject_CheckBuffer(sampled_token_ids):
        PyObject_GetBuffer(sampled_token_ids, &buffer, PyBUF_RECORDS_RO)
        have_buffer = True
    try:
        if have_buffer:
            _view_buffer(&buffer, &ids)
        else:
            _view_tensor(sampled_token_ids, &ids)
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


# ---------------------------------------------------------------------------
# update_async_spec_token_ids


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
        row = _as_row(<PyObject*>req_id, prev_index)
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
    """Replace each request's scheduled draft tokens with the real ones.

    The batch-wide equivalent of vLLM's ``InputBatch.update_async_spec_token_ids``
    loop (after its early returns): for each request, in order, whose
    ``spec_token_ids`` list is non-empty and whose id maps (through
    ``prev_req_id_to_index``) to a non-empty row of ``draft_token_ids``, cut
    that row to the request's length and copy it into the request's list.
    Returns the number of requests updated.
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


# ---------------------------------------------------------------------------
# output_tokens_tensor


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
    """The penalties' padded ``[num_reqs, max_len]`` int64 CPU tensor.

    Exactly what vLLM's penalties compute from ``output_token_ids`` before
    scattering them (``_convert_to_tensors`` and the ``masked_fill_`` of
    ``apply_all_penalties``): row ``i`` holds request ``i``'s token ids with
    every ``-1`` placeholder replaced by ``vocab_size``, padded with
    ``vocab_size`` to the longest row.  Written straight into a new torch
    tensor (pinned if ``pin_memory``), without vLLM's intermediate numpy array.
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
