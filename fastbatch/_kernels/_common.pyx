# Compiler directives are set in setup.py (one place, with a debug switch).
"""The shared part of the compiled pieces (declarations: ``_common.pxd``):
the one table of shared token-id objects, and the error paths of the inline
helpers."""

from cpython.object cimport PyObject


cdef extern from "Python.h":
    void* PyMem_RawCalloc(size_t nelem, size_t elsize)


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
