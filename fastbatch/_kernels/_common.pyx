# Compiler directives are set in setup.py (one place, with a debug switch).
"""The shared part of the compiled pieces (declarations: ``_common.pxd``):
the one table of shared token-id objects, and the error paths of the inline
helpers."""

from cpython.buffer cimport (
    PyBUF_FORMAT,
    PyBUF_STRIDES,
    PyBUF_WRITABLE,
    PyBuffer_Release,
    PyObject_GetBuffer,
)
from cpython.object cimport PyObject


cdef extern from "Python.h":
    void* PyMem_RawCalloc(size_t nelem, size_t elsize)


import sys

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
