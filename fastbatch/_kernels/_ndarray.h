/* Direct reads of a numpy.ndarray's fields, without numpy's headers.
 *
 * The buffer protocol makes numpy build a format string the first time each
 * array is viewed (about 0.4 us, then 0.2 us per view): far more than a piece
 * spends on a one-row array of a step.  These are the fields numpy's own
 * PyArray_DATA/NDIM/DIMS/STRIDES/DESCR/TYPE macros read in every compiled
 * extension, so numpy keeps their layout (numpy/ndarraytypes.h:
 * PyArrayObject_fields, and PyArray_Descr up to type_num, which numpy 2.0
 * kept in place with a "former flags" byte).  Only for an object whose type
 * is exactly numpy.ndarray (checked by the caller).  A view (base set) is
 * read in place only: it cannot be resized, and its base keeps its memory
 * while the view lives, as the export of the buffer protocol would.
 */
#ifndef FASTBATCH_NDARRAY_H
#define FASTBATCH_NDARRAY_H

#include <Python.h>

typedef struct {
    PyObject_HEAD
    PyTypeObject *typeobj;
    char kind;
    char type;
    char byteorder;
    char former_flags;
    int type_num;
} fastbatch_descr_prefix;

typedef struct {
    PyObject_HEAD
    char *data;
    int nd;
    Py_ssize_t *dimensions;
    Py_ssize_t *strides;
    PyObject *base;
    fastbatch_descr_prefix *descr;
} fastbatch_ndarray_prefix;

#define fastbatch_ndarray_data(a) ((const char *)((fastbatch_ndarray_prefix *)(a))->data)
#define fastbatch_ndarray_ndim(a) (((fastbatch_ndarray_prefix *)(a))->nd)
#define fastbatch_ndarray_dims(a) ((const Py_ssize_t *)((fastbatch_ndarray_prefix *)(a))->dimensions)
#define fastbatch_ndarray_strides(a) ((const Py_ssize_t *)((fastbatch_ndarray_prefix *)(a))->strides)
#define fastbatch_ndarray_is_view(a) (((fastbatch_ndarray_prefix *)(a))->base != NULL)
#define fastbatch_ndarray_type_num(a) (((fastbatch_ndarray_prefix *)(a))->descr->type_num)
#define fastbatch_ndarray_byteorder(a) (((fastbatch_ndarray_prefix *)(a))->descr->byteorder)

/* numpy's type numbers (NPY_TYPES, stable since numpy 1.0) of the dtypes read. */
enum {
    FASTBATCH_NPY_INT = 5,
    FASTBATCH_NPY_LONG = 7,
    FASTBATCH_NPY_LONGLONG = 9,
    FASTBATCH_NPY_FLOAT = 11,
    FASTBATCH_NPY_DOUBLE = 12
};

#endif /* FASTBATCH_NDARRAY_H */
