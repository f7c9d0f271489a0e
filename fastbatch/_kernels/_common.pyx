# Compiler directives are set in setup.py (one place, with a debug switch).
"""The shared part of the compiled pieces (declarations: ``_common.pxd``):
the one table of shared token-id objects, the error paths of the inline
helpers, and the view of a 2-D int tensor or buffer with the builders of
plain-list rows from it (the rows-to-lists pieces and the output-token piece
read sampled ids through it)."""

import operator
import sys

from cpython.buffer cimport (
    PyBUF_FORMAT,
    PyBUF_RECORDS_RO,
    PyBUF_STRIDES,
    PyBUF_WRITABLE,
    PyBuffer_Release,
    PyObject_GetBuffer,
)
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE, PyList_New
from cpython.object cimport PyObject
from libc.stdint cimport int32_t, int64_t


from fastbatch._kernels._prefetch cimport prefetch_read


cdef bint LITTLE_ENDIAN = sys.byteorder == "little"
cdef PyObject** _token_table = NULL


cdef PyObject** token_table() noexcept:
    """The process-wide table behind ``token_object``, allocated on first use
    (2 MiB of pointers); NULL if that allocation failed (``token_object`` then
    allocates every int)."""
    global _token_table
    if _token_table == NULL:
        _token_table = <PyObject**>PyMem_RawCalloc(TOKEN_CACHE_SIZE, sizeof(PyObject*))
    return _token_table


cdef class RequestPrefetch:
    """Group prefetching of a piece's loop over requests: a pipeline of
    stages, ``PREFETCH_DISTANCE`` requests apart, ahead of the request the
    loop reads.  After a forward pass the requests are out of the caches, and
    each read waits on memory; the stages overlap those waits.

    ``advance(i, request)`` as the loop comes to its request ``i``, with the
    request it will read ``3 * PREFETCH_DISTANCE`` later (borrowed, NULL for
    none): that request's object (and the instance-dict pointer before it),
    then, a distance on, its instance dict, then its dict's keys table (a
    ``Request`` has more attributes than CPython shares keys for, so each has
    its own, about 1.5 KB).  Only hints: they read what the loop reads, never
    change a result, and a reference is held to each object the stages come
    back to (released as the loop reaches it, or with the prefetcher)."""

    def __cinit__(self, request_type):
        self.request_type = request_type
        self.keys_bytes = 0

    def __dealloc__(self):
        cdef Py_ssize_t i
        for i in range(PREFETCH_RING):
            Py_XDECREF(self.objects[i])

    cdef void advance(self, Py_ssize_t i, PyObject* request) noexcept:
        cdef Py_ssize_t slot
        cdef PyObject* obj
        cdef PyObject* attrs
        # Each slot is set before what it held is released: a release may run
        # arbitrary code, and a prefetcher kept across calls (the output
        # processor's) may be come back to from it.
        # The request object, and the instance-dict pointer before it.
        slot = (i + 3 * PREFETCH_DISTANCE) & (PREFETCH_RING - 1)
        obj = self.objects[slot]
        self.objects[slot] = request
        if request != NULL:
            Py_INCREF(request)
            prefetch_read(request)
            prefetch_read(<char*>request - 4 * sizeof(void*))
        Py_XDECREF(obj)
        # The dict object (it holds the keys table's pointer).
        slot = (i + 2 * PREFETCH_DISTANCE) & (PREFETCH_RING - 1)
        obj = self.objects[slot]
        if obj != NULL:
            attrs = NULL
            if type_of(obj) == <PyObject*>self.request_type:
                attrs = instance_dict(obj, NULL)
                if attrs == NULL:
                    PyErr_Clear()
                else:
                    prefetch_read(attrs)
            self.objects[slot] = attrs
            Py_DECREF(obj)
        # The keys table, every line of it.
        attrs = self.objects[(i + PREFETCH_DISTANCE) & (PREFETCH_RING - 1)]
        if attrs != NULL:
            self._prefetch_keys(attrs)
        # The loop is on request i: let it go.
        slot = i & (PREFETCH_RING - 1)
        obj = self.objects[slot]
        self.objects[slot] = NULL
        Py_XDECREF(obj)

    cdef void start_in_list(self, list requests, Py_ssize_t first) noexcept:
        """Primed for a loop over ``requests`` from ``requests[first]`` on."""
        cdef Py_ssize_t i
        for i in range(first - 3 * PREFETCH_DISTANCE, first):
            self.advance_in_list(requests, i)

    cdef void advance_in_list(self, list requests, Py_ssize_t i) noexcept:
        """``advance`` as a loop over ``requests`` comes to ``requests[i]``."""
        cdef Py_ssize_t ahead = i + 3 * PREFETCH_DISTANCE
        cdef PyObject* request = NULL
        if 0 <= ahead < PyList_GET_SIZE(requests):
            request = <PyObject*>PyList_GET_ITEM(requests, ahead)
        self.advance(i, request)

    cdef void _prefetch_keys(self, PyObject* attrs) noexcept:
        cdef char* keys = <char*>(<PyDictObject*>attrs).ma_keys
        cdef Py_ssize_t offset
        if self.keys_bytes == 0:
            # The table's size, from the first dict: the requests of an engine
            # are built alike (a guess for the others costs only time).
            self.keys_bytes = min(max(1, (<object>attrs).__sizeof__() - sizeof(PyDictObject)),
                                  MAX_PREFETCH_BYTES)
        for offset in range(0, self.keys_bytes, 64):
            prefetch_read(keys + offset)


cdef class ScheduledPrefetch:
    """``RequestPrefetch`` for a loop over ``scheduled``, a dict keyed by
    request id (``num_scheduled_tokens``, say), that reads each request from
    ``requests``: each id (its hash: the lookup reads it) is prefetched a
    ``PREFETCH_DISTANCE`` before the request's own stages.  Made as the loop
    starts (primed); ``advance(i)`` as it comes to its ``i``-th item."""

    def __cinit__(self, dict scheduled, dict requests, request_type):
        cdef Py_ssize_t i
        self.scheduled, self.requests = scheduled, requests
        self.stages = RequestPrefetch(request_type)
        self.num_requests = len(scheduled)
        self.pos = 0
        for i in range(-4 * PREFETCH_DISTANCE, 0):
            self.advance(i)

    cdef void advance(self, Py_ssize_t i) noexcept:
        cdef Py_ssize_t j
        cdef PyObject* key
        cdef PyObject* value
        cdef PyObject* request = NULL
        j = i + 4 * PREFETCH_DISTANCE
        if 0 <= j < self.num_requests and PyDict_Next(self.scheduled, &self.pos, &key, &value):
            self.ids[j & (PREFETCH_RING - 1)] = key
            prefetch_read(key)
        j = i + 3 * PREFETCH_DISTANCE
        if 0 <= j < self.num_requests:
            request = dict_get_hint(<PyObject*>self.requests, self.ids[j & (PREFETCH_RING - 1)])
            if request == NULL:
                PyErr_Clear()
        self.stages.advance(i, request)


cdef Py_ssize_t as_row_slow(PyObject* req_id, PyObject* prev_index) except -1:
    """The general case of ``as_row``, with the errors.

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


cdef int view_int_column(object array, str name, Py_buffer* view, int flags,
                         bint int32_too) except -1:
    """Acquire ``array`` as a 1-D int64 (or, with ``int32_too``, int32) buffer
    of any stride; the caller releases ``view``.  ``flags`` adds
    PyBUF_WRITABLE where a piece writes.  A TypeError naming ``name`` for
    anything else, with nothing held.
    """
    cdef const char* fmt
    try:
        PyObject_GetBuffer(array, view, flags | PyBUF_FORMAT | PyBUF_STRIDES)
    except (TypeError, ValueError, BufferError) as exc:
        raise TypeError(f"{name} must be a {'writable ' if flags & PyBUF_WRITABLE else ''}"
                        f"1-D int array, got "
                        f"{type(array).__name__} ({exc})") from None
    fmt = view.format
    if fmt[0] == b"@" or fmt[0] == b"=" or (fmt[0] == b"<" and LITTLE_ENDIAN):
        fmt += 1
    if (view.ndim == 1 and fmt[1] == 0
            and ((view.itemsize == 8 and fmt[0] in (b"l", b"q"))
                 or (int32_too and view.itemsize == 4 and fmt[0] in (b"i", b"l")))):
        return 0
    ndim, form = view.ndim, view.format.decode()
    PyBuffer_Release(view)
    raise TypeError(f"{name} must be a 1-D {'int32 or int64' if int32_too else 'int64'} "
                    f"array, got a {ndim}-D array of format {form!r}")
# ---------------------------------------------------------------------------
# The view of a 2-D int tensor or buffer, and plain-list rows built from it.

cdef object TORCH_INT32 = None    # torch.int32, torch.int64 and torch.strided,
cdef object TORCH_INT64 = None    # looked up once, when the first tensor comes
cdef object TORCH_STRIDED = None


cdef int _view_buffer(const Py_buffer* buffer, SampledIds* ids, str name) except -1:
    """Fill ``ids`` from an acquired buffer (the caller releases it)."""
    cdef const char* fmt = buffer.format
    if fmt[0] == b"@" or fmt[0] == b"=" or (fmt[0] == b"<" and LITTLE_ENDIAN):
        fmt += 1
    if (buffer.ndim != 2 or buffer.itemsize not in (4, 8)
            or fmt[0] not in (b"i", b"l", b"q") or fmt[1] != 0):
        raise TypeError(
            f"{name} must be a 2-D int32 or int64 array, got a "
            f"{buffer.ndim}-D array of format {buffer.format.decode()!r}"
        )
    ids.data = <const char*>buffer.buf
    ids.num_rows, ids.width = buffer.shape[0], buffer.shape[1]
    ids.row_stride, ids.col_stride = buffer.strides[0], buffer.strides[1]
    ids.is_int64 = buffer.itemsize == 8
    return 0


cdef int _view_tensor(object tensor, SampledIds* ids, str name) except -1:
    """Fill ``ids`` from a torch CPU tensor, sharing its memory."""
    global TORCH_INT32, TORCH_INT64, TORCH_STRIDED
    dtype = getattr(tensor, "dtype", None)
    if TORCH_INT64 is None and "torch" in sys.modules:
        torch = sys.modules["torch"]
        TORCH_INT32, TORCH_INT64, TORCH_STRIDED = torch.int32, torch.int64, torch.strided
    if dtype is None:
        raise TypeError(
            f"{name} must be a 2-D int32 or int64 array or CPU "
            f"tensor, got {type(tensor).__name__}"
        )
    if dtype is not TORCH_INT64 and dtype is not TORCH_INT32:
        raise TypeError(f"{name} must be int32 or int64, got {dtype}")
    if not tensor.is_cpu:
        raise TypeError(f"{name} must be on the CPU, got {tensor.device}")
    if tensor.layout is not TORCH_STRIDED:  # asked first: stride() would throw in C++
        raise TypeError(f"{name} must be a dense tensor, got {tensor.layout}")
    try:  # other storage-less tensors have neither
        strides = tensor.stride()
        data = tensor.data_ptr()
    except RuntimeError:
        raise TypeError(
            f"{name} must be a dense tensor, got {tensor.layout}"
        ) from None
    if len(strides) != 2:
        raise TypeError(f"{name} must be 2-D, got a {len(strides)}-D tensor")
    shape = tensor.shape
    ids.is_int64 = dtype is TORCH_INT64
    itemsize = 8 if ids.is_int64 else 4
    ids.data = <const char*><size_t>data
    ids.num_rows, ids.width = shape[0], shape[1]
    ids.row_stride, ids.col_stride = strides[0] * itemsize, strides[1] * itemsize
    return 0


cdef int view_ids(object source, SampledIds* ids, Py_buffer* buffer,
                  bint* have_buffer, str name) except -1:
    have_buffer[0] = False
    if not PyObject_CheckBuffer(source):
        return _view_tensor(source, ids, name)
    PyObject_GetBuffer(source, buffer, PyBUF_RECORDS_RO)
    have_buffer[0] = True
    try:
        return _view_buffer(buffer, ids, name)
    except BaseException:
        have_buffer[0] = False
        PyBuffer_Release(buffer)
        raise


cdef list _rows_to_lists(const SampledIds* ids, Py_ssize_t num_rows, Py_ssize_t width,
                         const unsigned char* cleared, const sampled_t* dtype):
    cdef PyObject** table = token_table()
    cdef list rows = PyList_New(num_rows)
    cdef list row_ids
    cdef PyObject* token
    cdef Py_ssize_t row, col
    for row in range(num_rows):
        if cleared != NULL and cleared[row]:
            row_ids = PyList_New(0)
        else:
            row_ids = PyList_New(width)
            for col in range(width):
                token = token_object(table, id_at(ids, row, col, dtype))
                if token == NULL:
                    raise MemoryError()  # row_ids, freed, skips its unfilled slots
                list_set_item(<PyObject*>row_ids, col, token)
        Py_INCREF(<PyObject*>row_ids)
        list_set_item(<PyObject*>rows, row, <PyObject*>row_ids)
    return rows


cdef list rows_to_lists(const SampledIds* ids, Py_ssize_t num_rows, Py_ssize_t width,
                        const unsigned char* cleared):
    if ids.is_int64:
        return _rows_to_lists(ids, num_rows, width, cleared, <const int64_t*>NULL)
    return _rows_to_lists(ids, num_rows, width, cleared, <const int32_t*>NULL)


cdef inline bint _is_valid(sampled_t value, int64_t vocab_size) noexcept nogil:
    return value != -1 and value < vocab_size


cdef list _valid_rows_to_lists(const SampledIds* ids, int64_t vocab_size,
                               const unsigned char* cleared, const sampled_t* dtype):
    cdef PyObject** table = token_table()
    cdef list rows = PyList_New(ids.num_rows)
    cdef list row_ids
    cdef PyObject* token
    cdef sampled_t value
    cdef Py_ssize_t row, col, count, position
    for row in range(ids.num_rows):
        count = 0
        if cleared == NULL or not cleared[row]:
            for col in range(ids.width):
                count += _is_valid(id_at(ids, row, col, dtype), vocab_size)
        row_ids = PyList_New(count)
        position = 0
        col = 0
        while position < count:
            value = id_at(ids, row, col, dtype)
            col += 1
            if not _is_valid(value, vocab_size):
                continue
            token = token_object(table, value)
            if token == NULL:
                raise MemoryError()  # row_ids, freed, skips its unfilled slots
            list_set_item(<PyObject*>row_ids, position, token)
            position += 1
        Py_INCREF(<PyObject*>row_ids)
        list_set_item(<PyObject*>rows, row, <PyObject*>row_ids)
    return rows


cdef list valid_rows_to_lists(const SampledIds* ids, int64_t vocab_size,
                              const unsigned char* cleared):
    if ids.is_int64:
        return _valid_rows_to_lists(ids, vocab_size, cleared, <const int64_t*>NULL)
    return _valid_rows_to_lists(ids, vocab_size, cleared, <const int32_t*>NULL)


cdef Py_ssize_t _row_index(Py_ssize_t index, Py_ssize_t num_rows, str name) except -1:
    """``index`` as a row number, negative ones from the end, else IndexError."""
    cdef Py_ssize_t row = index + num_rows if index < 0 else index
    if row < 0 or row >= num_rows:
        raise IndexError(f"{name}: index {index} is out of range for {num_rows} rows")
    return row


cdef int _flag_buffer(object indices, Py_ssize_t num_rows, unsigned char* flags,
                      str name) except -1:
    """``flag_rows`` of a 1-D integer buffer (a numpy index array, say)."""
    cdef Py_buffer buffer
    cdef const char* fmt
    cdef const char* item
    cdef Py_ssize_t i
    cdef long long value
    PyObject_GetBuffer(indices, &buffer, PyBUF_RECORDS_RO)
    try:
        fmt = buffer.format
        if fmt[0] == b"@" or fmt[0] == b"=" or (fmt[0] == b"<" and LITTLE_ENDIAN):
            fmt += 1
        if (buffer.ndim != 1 or fmt[0] == 0 or fmt[1] != 0
                or fmt[0] not in b"bhilqBHILQ" or buffer.itemsize not in (1, 2, 4, 8)):
            raise TypeError(
                f"{name} must be a list of ints or a 1-D integer array, got a "
                f"{buffer.ndim}-D array of format {buffer.format.decode()!r}")
        for i in range(buffer.shape[0]):
            item = <const char*>buffer.buf + i * buffer.strides[0]
            if fmt[0] in b"bhilq":
                if buffer.itemsize == 1:
                    value = (<const signed char*>item)[0]
                elif buffer.itemsize == 2:
                    value = (<const short*>item)[0]
                elif buffer.itemsize == 4:
                    value = (<const int*>item)[0]
                else:
                    value = (<const long long*>item)[0]
            else:
                if buffer.itemsize == 1:
                    value = (<const unsigned char*>item)[0]
                elif buffer.itemsize == 2:
                    value = (<const unsigned short*>item)[0]
                elif buffer.itemsize == 4:
                    value = (<const unsigned int*>item)[0]
                elif (<const unsigned long long*>item)[0] > <unsigned long long>num_rows:
                    value = num_rows  # beyond int64: out of range all the same
                else:
                    value = <long long>(<const unsigned long long*>item)[0]
            flags[_row_index(<Py_ssize_t>value, num_rows, name)] = 1
    finally:
        PyBuffer_Release(&buffer)
    return 0


cdef int flag_rows(object indices, Py_ssize_t num_rows, unsigned char* flags,
                   str name, bint numpy_rules) except -1:
    cdef Py_ssize_t i, index
    cdef PyObject* item
    if numpy_rules:
        if PyList_CheckExact(<PyObject*>indices):
            for i in range(PyList_GET_SIZE(indices)):
                item = PyList_GET_ITEM(indices, i)
                if not PyLong_CheckExact(item):
                    raise TypeError(f"{name} must be a list of ints, got an item "
                                    f"of type {type(<object>item).__name__}")
                try:
                    index = <object>item
                except OverflowError:
                    raise IndexError(f"{name}: index {<object>item} is out of "
                                     f"range for {num_rows} rows") from None
                flags[_row_index(index, num_rows, name)] = 1
            return 0
        if PyObject_CheckBuffer(indices):
            return _flag_buffer(indices, num_rows, flags, name)
        if PyTuple_Check(<PyObject*>indices) and Py_SIZE(<PyObject*>indices) == 0:
            return 0
        raise TypeError(f"{name} must be a list of ints or a 1-D integer array, "
                        f"got {type(indices).__name__}")
    for value in indices:
        try:
            index = operator.index(value)
        except TypeError:
            raise TypeError(f"{name} must hold ints, got "
                            f"{type(value).__name__}") from None
        except OverflowError:
            raise IndexError(f"{name}: index {value} is out of range for "
                             f"{num_rows} rows") from None
        flags[_row_index(index, num_rows, name)] = 1
    return 0
