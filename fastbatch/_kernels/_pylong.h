/* Inline reads of small Python ints for the kernel's per-request checks.
 *
 * Token ids and row numbers are small non-negative ints; CPython stores them
 * "compact" (one digit), and reading that digit inline saves a call into
 * libpython per item.  Anything else takes the exact, general API path.
 * 3.12 changed the int layout and added PyUnstable_Long_* for this purpose;
 * before it, the sign and digit count are in ob_size.
 */
#ifndef FASTBATCH_PYLONG_H
#define FASTBATCH_PYLONG_H

#include <Python.h>
#if PY_VERSION_HEX < 0x030B0000
#include <longintrepr.h> /* PyLongObject's digits: Python.h has them from 3.11 */
#endif

/* 1 if the int object `o` equals -1, else 0 (never raises). */
static inline int fastbatch_long_is_minus_one(PyObject *o)
{
    int overflow = 0;
    long long value;
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)o))
        return PyUnstable_Long_CompactValue((PyLongObject *)o) == -1;
#else
    if (Py_SIZE(o) >= 0)
        return 0; /* zero or positive */
#endif
    value = PyLong_AsLongLongAndOverflow(o, &overflow);
    return value == -1 && overflow == 0;
}

/* The value of the int object `o` if it is a non-negative compact int,
 * else -1 (the caller then takes the general, error-reporting path). */
static inline Py_ssize_t fastbatch_long_as_small_index(PyObject *o)
{
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)o)) {
        Py_ssize_t value = PyUnstable_Long_CompactValue((PyLongObject *)o);
        return value >= 0 ? value : -1;
    }
    return -1;
#else
    Py_ssize_t size = Py_SIZE(o);
    if (size == 0)
        return 0;
    if (size == 1)
        return (Py_ssize_t)((PyLongObject *)o)->ob_digit[0];
    return -1;
#endif
}

/* Store the value of the int object `o` in *value and return 1 if it is
 * compact (every token id is), else return 0 without touching *value. */
static inline int fastbatch_long_as_compact(PyObject *o, long long *value)
{
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)o)) {
        *value = (long long)PyUnstable_Long_CompactValue((PyLongObject *)o);
        return 1;
    }
    return 0;
#else
    Py_ssize_t size = Py_SIZE(o);
    if (size == 0) {
        *value = 0;
        return 1;
    }
    if (size == 1 || size == -1) {
        *value = (long long)size * (long long)((PyLongObject *)o)->ob_digit[0];
        return 1;
    }
    return 0;
#endif
}

#endif
