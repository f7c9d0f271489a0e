# cython: language_level=3, boundscheck=False, wraparound=False
"""The floors: the work no implementation of an update can skip.

``floor_update`` (output tokens): per request one dict lookup (request id ->
row) and one list store of the sampled id (a new int object over the last
placeholder); no validation, no placeholder scan, no spec decode.
``spec_floor_update`` (spec tokens): see its docstring.  Built by
benchmarks/conftest.py with the same compiler and flags as the kernel; the
benchmarks compare fastbatch with them.
"""

from cpython.object cimport PyObject

cdef extern from "Python.h":
    PyObject* PyDict_GetItemWithError(PyObject* mp, PyObject* key) except? NULL
    Py_ssize_t PyLong_AsSsize_t(PyObject* o) except? -1
    PyObject* PyList_GET_ITEM(PyObject* lst, Py_ssize_t i)
    Py_ssize_t PyList_GET_SIZE(PyObject* lst)
    PyObject* new_int "PyLong_FromLongLong"(long long value) except NULL
    void list_set_item "PyList_SET_ITEM"(PyObject* lst, Py_ssize_t i, PyObject* item)
    void Py_DECREF(PyObject* o)
    void Py_INCREF(PyObject* o)
    void Py_SET_SIZE(PyObject* o, Py_ssize_t size)


def floor_update(list req_ids, dict prev_req_id_to_index, list output_token_ids,
                 sampled_token_ids):
    """One dict lookup and one list store per request (int32 CPU tensor ids)."""
    cdef const int* ids = <const int*><size_t>sampled_token_ids.data_ptr()
    cdef Py_ssize_t row_stride = sampled_token_ids.stride()[0]
    cdef Py_ssize_t index, row, last
    cdef PyObject* prev_index
    cdef PyObject* token_ids
    cdef PyObject* old
    for index in range(len(req_ids)):
        prev_index = PyDict_GetItemWithError(<PyObject*>prev_req_id_to_index,
                                             PyList_GET_ITEM(<PyObject*>req_ids, index))
        if prev_index == NULL:
            continue
        row = PyLong_AsSsize_t(prev_index)
        token_ids = PyList_GET_ITEM(<PyObject*>output_token_ids, index)
        last = PyList_GET_SIZE(token_ids) - 1
        old = PyList_GET_ITEM(token_ids, last)
        list_set_item(token_ids, last, new_int(ids[row * row_stride]))
        Py_DECREF(old)


def spec_floor_update(list req_ids, dict prev_req_id_to_index, list spec_token_ids,
                      list draft_token_ids):
    """The spec-token update's floor: per request one dict lookup, then the
    draft row's first items copied over the spec list's in place and both
    lists cut to the shorter length; no validation, no aliasing care.  Gives
    vLLM's result on the benchmark's states (no ``None``, no shared lists)."""
    cdef Py_ssize_t index, j, row, count, spec_size, draft_size
    cdef PyObject* prev_index
    cdef PyObject* spec
    cdef PyObject* draft
    cdef PyObject* item
    cdef PyObject* old
    for index in range(len(req_ids)):
        spec = PyList_GET_ITEM(<PyObject*>spec_token_ids, index)
        spec_size = PyList_GET_SIZE(spec)
        if spec_size == 0:
            continue
        prev_index = PyDict_GetItemWithError(<PyObject*>prev_req_id_to_index,
                                             PyList_GET_ITEM(<PyObject*>req_ids, index))
        if prev_index == NULL:
            continue
        row = PyLong_AsSsize_t(prev_index)
        draft = PyList_GET_ITEM(<PyObject*>draft_token_ids, row)
        draft_size = PyList_GET_SIZE(draft)
        if draft_size == 0:
            continue
        count = draft_size if draft_size < spec_size else spec_size
        for j in range(count):
            item = PyList_GET_ITEM(draft, j)
            Py_INCREF(item)
            old = PyList_GET_ITEM(spec, j)
            list_set_item(spec, j, item)
            Py_DECREF(old)
        for j in range(count, spec_size):
            Py_DECREF(PyList_GET_ITEM(spec, j))
        Py_SET_SIZE(spec, count)
        for j in range(count, draft_size):
            Py_DECREF(PyList_GET_ITEM(draft, j))
        Py_SET_SIZE(draft, count)
