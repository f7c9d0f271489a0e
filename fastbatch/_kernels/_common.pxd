# Compiler directives are set in setup.py (one place, with a debug switch).
"""What the compiled pieces share: borrowed-pointer C API, small-int reads,
row numbers, the table of shared token-id objects, and the zero-copy view of
a 2-D int32/int64 CPU tensor or buffer (``SampledIds``) with the builders of
plain ``list`` rows from it.

Each piece (``fastbatch/_kernels/<piece>.pyx``, named like its patch in
``fastbatch/patches/``) cimports this; the inline helpers are compiled into
every piece, so the hot loops keep their inlined fast paths, while the token
table and the error paths live once, in ``_common.pyx``.
"""

cimport cython
from cpython.object cimport PyObject
from cpython.buffer cimport Py_buffer
from libc.stdint cimport int32_t, int64_t
from libc.string cimport memcpy


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
    PyObject* Py_None
    void Py_SET_SIZE(PyObject* o, Py_ssize_t size)
    # itemlist NULL deletes the slice (no list is allocated).
    int PyList_SetSlice(PyObject* lst, Py_ssize_t low, Py_ssize_t high,
                        PyObject* itemlist) except -1
    # Borrowed-pointer forms for the prefetch stages, which never raise: an
    # error is cleared (a hint only: the piece's loop meets it itself).
    PyObject* instance_dict "PyObject_GenericGetDict"(PyObject* o, void* context)
    PyObject* type_of "(PyObject*)Py_TYPE"(PyObject* o)
    PyObject* dict_get_hint "PyDict_GetItemWithError"(PyObject* mp, PyObject* key)
    void PyErr_Clear()
    dict PyObject_GenericGetDict(object o, void* context)
    bint PyDict_Next(object p, Py_ssize_t* pos, PyObject** key, PyObject** value)
    int PySequence_Contains(object o, object value) except -1
    const Py_ssize_t PY_SSIZE_T_MAX
    void* PyMem_RawCalloc(size_t nelem, size_t elsize)
    ctypedef struct PyDictObject:
        void* ma_keys  # public (cpython/dictobject.h); the table is not
    ctypedef struct PyMemberDef:
        int type
        Py_ssize_t offset
    ctypedef struct PyMemberDescrObject:
        PyMemberDef* d_member
    ctypedef struct VersionedType "PyTypeObject":
        unsigned int tp_version_tag  # changes when the type or a base is changed
    bint PyObject_IS_GC(object obj)
    void PyObject_GC_UnTrack(void* op)
    object PyUnicode_AsEncodedString(object text, const char* encoding,
                                     const char* errors)
    char* PyBytes_AS_STRING(object data)
    Py_ssize_t PyBytes_GET_SIZE(object data)
    PyObject* PyLong_FromLong(long value)
    bint PyUnicode_CheckExact(PyObject* o)
    Py_ssize_t PyUnicode_GET_LENGTH(PyObject* o)
    unsigned int PyUnicode_KIND(PyObject* o)
    bint PyUnicode_IS_ASCII(PyObject* o)
    Py_ssize_t Py_REFCNT(PyObject* o)
    int PyUnicode_Resize(PyObject** unicode, Py_ssize_t length) except -1
    Py_ssize_t PyUnicode_CopyCharacters(PyObject* to, Py_ssize_t to_start, PyObject* source,
                                        Py_ssize_t from_start, Py_ssize_t how_many) except -1
    PyObject* PyUnicode_Concat(PyObject* left, PyObject* right) except NULL
    PyObject* PyNumber_InPlaceAdd(PyObject* left, PyObject* right) except NULL
    int PyObject_SetAttr(object o, object name, object value) except -1


cdef extern from "_pylong.h":
    bint long_is_minus_one "fastbatch_long_is_minus_one"(PyObject* o) noexcept
    Py_ssize_t long_as_small_index "fastbatch_long_as_small_index"(PyObject* o) noexcept
    bint long_as_compact "fastbatch_long_as_compact"(PyObject* o,
                                                     long long* value) noexcept


cdef enum:
    # Lists up to this many items are rewritten in place (see the pieces).
    MAX_INLINE_TAIL = 16
    # Token ids below this are handed out as shared int objects (token_object).
    TOKEN_CACHE_SIZE = 1 << 18


cdef PyObject** token_table() noexcept


cdef inline PyObject* token_object(PyObject** table, int64_t value) noexcept:
    """A new reference to the int ``value`` (NULL, with MemoryError set, on failure).

    ``table`` is ``token_table()``, fetched once per call of a piece.  Token
    ids in [0, 2**18) (every common vocabulary) come from that process-wide
    table of shared int objects, filled on first use, as CPython does for
    -5..256: no allocation per token, and long outputs share objects instead
    of holding one 28-byte int per token.  Ints are immutable, so sharing
    them is invisible to vLLM (equal values, as its own ``tolist()`` gives).
    """
    cdef PyObject* token
    if value < 0 or value >= TOKEN_CACHE_SIZE or table == NULL:
        return new_int(value)
    token = table[value]
    if token == NULL:
        token = new_int(value)
        if token == NULL:
            return NULL
        table[value] = token  # the table keeps this reference
    Py_INCREF(token)
    return token


cdef inline bint as_index(object value, Py_ssize_t* out) noexcept:
    """True, with the value, for an exact int of up to one digit (every count
    the scheduler pieces read); False for anything else (then vLLM's code
    decides)."""
    cdef long long number
    if not PyLong_CheckExact(<PyObject*>value):
        return False
    if not long_as_compact(<PyObject*>value, &number):
        return False
    out[0] = <Py_ssize_t>number
    return True


cdef Py_ssize_t as_row_slow(PyObject* req_id, PyObject* prev_index) except -1


cdef inline Py_ssize_t as_row(PyObject* req_id, PyObject* prev_index) except -1:
    """vLLM's ``prev_index`` as a row number: an int >= 0, else a clear error."""
    cdef Py_ssize_t row = -1
    if PyLong_CheckExact(prev_index):
        row = long_as_small_index(prev_index)
    return row if row >= 0 else as_row_slow(req_id, prev_index)


cdef int view_int_column(object array, str name, Py_buffer* view, int flags,
                         bint int32_too) except -1
ctypedef fused sampled_t:
    int32_t
    int64_t


# A 2-D int32/int64 CPU tensor or buffer, read through its pointer and byte
# strides (no copy); filled by ``view_ids``.
ctypedef struct SampledIds:
    const char* data
    Py_ssize_t num_rows
    Py_ssize_t width
    Py_ssize_t row_stride         # in bytes
    Py_ssize_t col_stride         # in bytes
    bint is_int64


cdef int view_ids(object source, SampledIds* ids, Py_buffer* buffer,
                  bint* have_buffer, str name) except -1
# Fill ``ids`` from a torch CPU tensor or an object with the buffer protocol.
# ``name`` is the argument's name in the TypeError of anything else (another
# dtype or device, not 2-D, ...).  When ``*have_buffer`` comes back true the
# caller owns ``buffer`` and must ``PyBuffer_Release`` it.


cdef inline sampled_t id_at(const SampledIds* ids, Py_ssize_t row, Py_ssize_t col,
                            const sampled_t* dtype) noexcept nogil:
    """The id at (row, col); ``dtype`` only selects the fused type."""
    cdef sampled_t value = 0
    # memcpy: no alignment assumption; compilers emit a single load.
    memcpy(&value, ids.data + row * ids.row_stride + col * ids.col_stride,
           sizeof(sampled_t))
    return value


cdef list rows_to_lists(const SampledIds* ids, Py_ssize_t num_rows, Py_ssize_t width,
                        const unsigned char* cleared)
# ``[[ids[r][c] for c in range(width)] for r in range(num_rows)]`` as plain
# lists of plain ints (shared token-id objects), what ``tensor.tolist()`` gives;
# rows flagged in ``cleared`` (may be NULL) are empty lists.  The caller has
# checked ``num_rows``/``width`` against the view.


cdef list valid_rows_to_lists(const SampledIds* ids, int64_t vocab_size,
                              const unsigned char* cleared)
# Every row's ids that are not -1 and are below ``vocab_size``, in order, as
# plain lists of plain ints; rows flagged in ``cleared`` (may be NULL) are empty
# lists.  vLLM's ``row[(row != -1) & (row < vocab_size)].tolist()``.


cdef int flag_rows(object indices, Py_ssize_t num_rows, unsigned char* flags,
                   str name, bint numpy_rules) except -1
# Set ``flags[i]`` for every row index in ``indices``, Python's way (a
# negative index counts from the end; out of range is an IndexError naming
# ``name``).  Takes any iterable of ``__index__`` objects (a list's indexing),
# or, with ``numpy_rules``, only what numpy's fancy indexing reads the same
# way: a list of exact ints, an empty sequence, or a 1-D integer buffer
# (anything else, a list of bools say, is a TypeError).


cdef enum:
    # Requests between two stages of ``RequestPrefetch`` (and from the last
    # to the request's own reads), and its ring of requests in flight (a power
    # of two above the deepest stage a piece adds, 4 * the distance).
    PREFETCH_DISTANCE = 8
    PREFETCH_RING = 64
    # The most of a keys table prefetched (a Request's is about 1.5 KB).
    MAX_PREFETCH_BYTES = 4096


@cython.final
cdef class RequestPrefetch:
    # Group prefetching of a piece's loop over requests (see _common.pyx).
    cdef object request_type
    cdef Py_ssize_t keys_bytes
    cdef PyObject* objects[PREFETCH_RING]  # strong: the request, then its dict
    cdef void advance(self, Py_ssize_t i, PyObject* request) noexcept
    cdef void start_in_list(self, list requests, Py_ssize_t first) noexcept
    cdef void advance_in_list(self, list requests, Py_ssize_t i) noexcept
    cdef void _prefetch_keys(self, PyObject* attrs) noexcept


@cython.final
cdef class ScheduledPrefetch:
    # RequestPrefetch for a loop over a dict keyed by request id (see _common.pyx).
    cdef dict scheduled, requests
    cdef Py_ssize_t pos, num_requests
    cdef RequestPrefetch stages
    cdef PyObject* ids[PREFETCH_RING]  # borrowed from ``scheduled``
    cdef void advance(self, Py_ssize_t i) noexcept
