# Compiler directives are set in setup.py (one place, with a debug switch).
"""What the compiled pieces share: borrowed-pointer C API, small-int reads,
row numbers, and the table of shared token-id objects.

Each piece (``fastbatch/_kernels/<piece>.pyx``, named like its patch in
``fastbatch/patches/``) cimports this; the inline helpers are compiled into
every piece, so the hot loops keep their inlined fast paths, while the token
table and the error paths live once, in ``_common.pyx``.
"""

from cpython.object cimport PyObject
from libc.stdint cimport int64_t


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


cdef Py_ssize_t as_row_slow(PyObject* req_id, PyObject* prev_index) except -1


cdef inline Py_ssize_t as_row(PyObject* req_id, PyObject* prev_index) except -1:
    """vLLM's ``prev_index`` as a row number: an int >= 0, else a clear error."""
    cdef Py_ssize_t row = -1
    if PyLong_CheckExact(prev_index):
        row = long_as_small_index(prev_index)
    return row if row >= 0 else as_row_slow(req_id, prev_index)
