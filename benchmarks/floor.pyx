# cython: language_level=3, boundscheck=False, wraparound=False
"""The floor: the work no implementation of the update can skip.

Per request one dict lookup (request id -> row) and one list store of the
sampled id (a new int object over the last placeholder); no validation, no
placeholder scan, no spec decode.  Built by benchmarks/conftest.py with the
same compiler and flags as the kernel; the one-placeholder benchmarks compare
fastbatch with it.
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
