# Compiler directives are set in setup.py (one place, with a debug switch).
"""Compiled piece ``update_sample_logprobs``: vLLM's
``LogprobsProcessor._update_sample_logprobs``, which appends one request's
sample logprobs of a step (one position, or several with spec decoding) to
its logprobs in the output processor.

Two passes, as every piece: plan (read and check the arrays and the
processor, and find every text: the per-tokenizer table, and vLLM's own
U+FFFD correction; nothing is written but the table), then write (the
positions appended, the cumulative logprob).  ``update`` is the method
itself, bound on vLLM's class by the patch (a Cython function binds like a
Python one), with vLLM's signature: the compiled call with the
processor's tokenizer's table, vLLM's method (``bind``) for the rest, with
no Python frame between the output processor and the compiled call.
``fastbatch._reference`` holds the same behaviour in plain Python.
"""

__all__ = ["update_sample_logprobs"]

from cpython.buffer cimport PyBUF_RECORDS_RO, PyBuffer_Release, PyObject_GetBuffer
from cpython.dict cimport PyDict_SetItem
from cpython.float cimport PyFloat_AS_DOUBLE
from cpython.list cimport PyList_Append, PyList_GET_ITEM, PyList_GET_SIZE
from cpython.object cimport PyObject, PyObject_GenericSetAttr, PyTypeObject
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE
from cpython.unicode cimport PyUnicode_GET_LENGTH, PyUnicode_READ_CHAR
from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.string cimport memcpy

import dataclasses
import sys
import weakref

from fastbatch._kernels._common cimport (
    PyDict_GetItemWithError,
    PyLong_AsLongLongAndOverflow,
    PyLong_CheckExact,
    Py_DECREF,
    token_object,
    token_table,
)
from fastbatch._kernels._common cimport PyObject_GC_UnTrack, PyObject_IS_GC, VersionedType

# Process-wide counters, read with stats().
cdef uint64_t _calls = 0
cdef uint64_t _positions = 0
cdef uint64_t _decoded = 0
cdef uint64_t _corrected = 0

cdef bint LITTLE_ENDIAN = sys.byteorder == "little"
# The text vLLM corrects: one that ends in U+FFFD (an unfinished UTF-8 sequence).
cdef Py_UCS4 REPLACEMENT = 0xFFFD
# The context vLLM's ``_get_sampled_context_ids`` gives by default.
cdef Py_ssize_t MAX_CONTEXT = 4
# The attributes of a ``FlatLogprobs`` that ``append_fast`` appends to.
cdef tuple FLAT_LISTS = ("start_indices", "end_indices", "token_ids", "logprobs", "ranks",
                         "decoded_tokens")


def stats():
    """This piece's counters since import or the last ``reset_stats()``:
    ``calls`` and ``positions`` appended, texts ``decoded`` by the tokenizer
    (table misses) and ``corrected`` by vLLM's U+FFFD correction."""
    return {"calls": _calls, "positions": _positions, "decoded": _decoded,
            "corrected": _corrected}


def reset_stats():
    """Set every counter of ``stats()`` back to zero."""
    global _calls, _positions, _decoded, _corrected
    _calls = _positions = _decoded = _corrected = 0


ctypedef struct Array:
    const char* data
    Py_ssize_t rows
    Py_ssize_t cols
    Py_ssize_t row_stride     # in bytes
    Py_ssize_t col_stride     # in bytes
    Py_ssize_t itemsize       # 4 or 8: int32/float32 or int64/float64


cdef extern from "_ndarray.h":
    const char* ndarray_data "fastbatch_ndarray_data"(object array) noexcept
    int ndarray_ndim "fastbatch_ndarray_ndim"(object array) noexcept
    bint ndarray_is_view "fastbatch_ndarray_is_view"(object array) noexcept
    const Py_ssize_t* ndarray_dims "fastbatch_ndarray_dims"(object array) noexcept
    const Py_ssize_t* ndarray_strides "fastbatch_ndarray_strides"(object array) noexcept
    int ndarray_type_num "fastbatch_ndarray_type_num"(object array) noexcept
    char ndarray_byteorder "fastbatch_ndarray_byteorder"(object array) noexcept
    enum:
        NPY_INT "FASTBATCH_NPY_INT"
        NPY_LONG "FASTBATCH_NPY_LONG"
        NPY_LONGLONG "FASTBATCH_NPY_LONGLONG"
        NPY_FLOAT "FASTBATCH_NPY_FLOAT"
        NPY_DOUBLE "FASTBATCH_NPY_DOUBLE"

# numpy.ndarray, once numpy is imported (an array can only come from it).
cdef object NDARRAY = None


cdef bint _read_ndarray(object source, Array* array, int ndim, char kind) noexcept:
    """Fill ``array`` from an exact numpy.ndarray view (a slice, as vLLM's
    ``slice_request`` makes) of ``ndim`` dimensions and a native
    int/long/long long (``kind`` b"i") or float/double (b"f") dtype, read in
    place (see ``_ndarray.h``); False for anything else (the buffer protocol
    then reads it)."""
    global NDARRAY
    if NDARRAY is None:
        numpy = sys.modules.get("numpy")
        if numpy is None:
            return False
        NDARRAY = numpy.ndarray
    if (type(source) is not NDARRAY or ndarray_ndim(source) != ndim
            or not ndarray_is_view(source)):
        return False
    cdef int type_num = ndarray_type_num(source)
    cdef Py_ssize_t itemsize
    if ndarray_byteorder(source) != b"=":
        return False
    if kind == b"i" and type_num == NPY_INT:
        itemsize = sizeof(int)
    elif kind == b"i" and type_num == NPY_LONG:
        itemsize = sizeof(long)
    elif kind == b"i" and type_num == NPY_LONGLONG:
        itemsize = sizeof(long long)
    elif kind == b"f" and type_num == NPY_FLOAT:
        itemsize = sizeof(float)
    elif kind == b"f" and type_num == NPY_DOUBLE:
        itemsize = sizeof(double)
    else:
        return False
    if itemsize != 4 and itemsize != 8:
        return False
    cdef const Py_ssize_t* dims = ndarray_dims(source)
    cdef const Py_ssize_t* strides = ndarray_strides(source)
    array.data = ndarray_data(source)
    array.rows = dims[0]
    array.row_stride = strides[0]
    array.cols = dims[1] if ndim == 2 else 1
    array.col_stride = strides[1] if ndim == 2 else 0
    array.itemsize = itemsize
    return True


cdef bint _view(object source, Py_buffer* buffer, Array* array, int ndim, char kind,
                str name) except -1:
    """Read ``source`` as a ``ndim``-D int32/int64 (``kind`` b"i") or
    float32/float64 (b"f") array of any strides: a numpy array in place, True
    if ``buffer`` was acquired for it (the caller releases it); a TypeError
    naming ``name`` for anything else, with nothing held."""
    cdef const char* fmt
    if _read_ndarray(source, array, ndim, kind):
        return False
    try:
        PyObject_GetBuffer(source, buffer, PyBUF_RECORDS_RO)
    except (TypeError, ValueError, BufferError) as exc:
        raise TypeError(f"{name} must be a {ndim}-D numpy array, got "
                        f"{type(source).__name__} ({exc})") from None
    fmt = buffer.format
    if fmt[0] == b"@" or fmt[0] == b"=" or (fmt[0] == b"<" and LITTLE_ENDIAN):
        fmt += 1
    if (buffer.ndim == ndim and fmt[1] == 0 and buffer.itemsize in (4, 8)
            and ((kind == b"i" and fmt[0] in (b"i", b"l", b"q"))
                 or (kind == b"f" and fmt[0] in (b"f", b"d")))):
        array.data = <const char*>buffer.buf
        array.rows = buffer.shape[0]
        array.row_stride = buffer.strides[0]
        array.cols = buffer.shape[1] if ndim == 2 else 1
        array.col_stride = buffer.strides[1] if ndim == 2 else 0
        array.itemsize = buffer.itemsize
        return True
    found, form = buffer.ndim, buffer.format.decode()
    PyBuffer_Release(buffer)
    kinds = "int32 or int64" if kind == b"i" else "float32 or float64"
    raise TypeError(f"{name} must be a {ndim}-D {kinds} array, got a {found}-D array "
                    f"of format {form!r}")


cdef inline int64_t _int_at(const Array* array, Py_ssize_t row, Py_ssize_t col) noexcept:
    cdef const char* at = array.data + row * array.row_stride + col * array.col_stride
    cdef int32_t small
    cdef int64_t large
    if array.itemsize == 4:
        memcpy(&small, at, 4)
        return small
    memcpy(&large, at, 8)
    return large


cdef inline double _float_at(const Array* array, Py_ssize_t row, Py_ssize_t col) noexcept:
    """The item as ``tolist()`` gives it: a float32 widened to a double, exactly."""
    cdef const char* at = array.data + row * array.row_stride + col * array.col_stride
    cdef float small
    cdef double large
    if array.itemsize == 4:
        memcpy(&small, at, 4)
        return <double>small
    memcpy(&large, at, 8)
    return large


cdef inline bint _sampled_again(const Array* token_ids, Py_ssize_t p, Py_ssize_t kept) noexcept:
    """Whether the sampled id of position ``p`` is also one of its top ids
    (always, with greedy sampling): vLLM's dict then keeps the sampled
    token's place and a later column's ``Logprob``."""
    cdef int64_t sampled = _int_at(token_ids, p, 0)
    cdef Py_ssize_t c
    for c in range(1, kept):
        if _int_at(token_ids, p, c) == sampled:
            return True
    return False


# The last Logprob type checked by _plain_dataclass, its version then (0:
# none, not kept) and the answer.
cdef object _checked_type = None
cdef unsigned int _checked_version = 0
cdef bint _checked_plain = False


@dataclasses.dataclass
class _PlainLogprob:
    """The ``Logprob`` of vLLM 0.32.0 to 0.34.0, field for field: a type whose
    ``__init__`` is the same code makes its instances as ``_new_logprob``."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


cdef bint _plain_dataclass(object kind):
    """Whether calling ``kind(logprob, rank, decoded_token)`` does no more than
    ``object.__new__(kind)`` and the three attributes stored in that order
    (``_new_logprob``): a plain class of ``type`` whose ``__new__`` and
    ``__setattr__`` are ``object``'s and whose ``__init__`` has the code of
    ``_PlainLogprob``'s (the dataclass ``__init__`` of those three fields, no
    ``__post_init__``).  Kept for the last type asked while it is unchanged
    (its version tag)."""
    global _checked_type, _checked_version, _checked_plain
    if (kind is _checked_type and _checked_version != 0
            and (<VersionedType*>kind).tp_version_tag == _checked_version):
        return _checked_plain
    plain = False
    if type(kind) is type:
        init = getattr(kind, "__init__", None)
        code = getattr(init, "__code__", None)
        reference = _PlainLogprob.__init__.__code__
        plain = (kind.__new__ is object.__new__ and kind.__setattr__ is object.__setattr__
                 and code is not None and code.co_code == reference.co_code
                 and code.co_names == reference.co_names
                 and code.co_varnames == reference.co_varnames
                 and code.co_consts == reference.co_consts
                 and getattr(init, "__kwdefaults__", None) is None)
    _checked_type, _checked_plain = kind, plain
    _checked_version = (<VersionedType*>kind).tp_version_tag if type(kind) is type else 0
    return plain


cdef inline object _new_logprob(object kind, bint plain, object value, object rank,
                                object text):
    """``kind(value, rank, text)``; for a plain dataclass ``Logprob``
    (``_plain_dataclass``) what its ``__init__`` does, without the Python
    frame: ``object.__new__`` and the three attributes stored in its order."""
    if not plain:
        return kind(value, rank, text)
    logprob = (<PyTypeObject*>kind).tp_new(kind, <PyObject*>(), NULL)
    PyObject_GenericSetAttr(logprob, "logprob", value)
    PyObject_GenericSetAttr(logprob, "rank", rank)
    PyObject_GenericSetAttr(logprob, "decoded_token", text)
    return logprob


cdef inline object _token(PyObject** table, int64_t value):
    """The int ``value`` (a shared token-id object, see ``token_object``)."""
    cdef PyObject* item = token_object(table, value)
    if item == NULL:
        raise MemoryError()
    token = <object>item  # Cython's own reference
    Py_DECREF(item)       # token_object's
    return token


cdef inline bint _unfinished(object text) noexcept:
    """vLLM's ``text.endswith("\\ufffd")`` for an exact str."""
    cdef Py_ssize_t length = PyUnicode_GET_LENGTH(text)
    return length > 0 and PyUnicode_READ_CHAR(text, length - 1) == REPLACEMENT


cdef object _text(dict texts, object convert, object tokenizer, object token):
    """The text of ``token``: the table's, or (first time) the one vLLM's
    ``convert(tokenizer, [token])`` returns, then kept in the table."""
    global _decoded
    cdef PyObject* found = PyDict_GetItemWithError(<PyObject*>texts, <PyObject*>token)
    if found != NULL:
        return <object>found
    converted = convert(tokenizer, [token])
    if type(converted) is not list or PyList_GET_SIZE(converted) != 1:
        raise TypeError(f"the tokenizer's texts of [{token}] must be a list of one str, "
                        f"got {converted!r}")
    text = <object>PyList_GET_ITEM(converted, 0)
    if type(text) is not str:
        raise TypeError(f"the tokenizer's text of {token} must be a str, got "
                        f"{type(text).__name__}")
    texts[token] = text
    _decoded += 1
    return text


cdef list _context(object processor, object container, const Array* token_ids,
                   Py_ssize_t position):
    """vLLM's ``_get_sampled_context_ids(self.logprobs)`` as it would be
    called for ``position`` of this call: the sampled ids of the last
    positions, those of this call's earlier positions included (each has an
    entry, so vLLM's filter keeps them)."""
    cdef Py_ssize_t earlier = min(position, MAX_CONTEXT), p
    cdef list context
    if earlier < MAX_CONTEXT:
        context = processor._get_sampled_context_ids(container, MAX_CONTEXT - earlier)
        if type(context) is not list:
            raise TypeError(f"_get_sampled_context_ids must return a list, got "
                            f"{type(context).__name__}")
        context = list(context)
    else:
        context = []
    for p in range(position - earlier, position):
        context.append(_int_at(token_ids, p, 0))
    return context


# Set by bind(): vLLM's method, the patch's per-tokenizer entry, the
# first-sight texts (``convert``), kinds.
cdef object _stock = None
cdef object _entry_of = None
cdef object _convert = None
cdef tuple _kinds = None
# The last tokenizer seen (weakly) and its entry.
cdef object _last_tokenizer = None
cdef object _last_entry = None


def bind(stock, entry_of, convert, tuple kinds not None):
    """Make ``update`` answer for this vLLM: ``stock`` is vLLM's own
    ``LogprobsProcessor._update_sample_logprobs`` (it answers every call
    ``update_sample_logprobs`` does not take), ``entry_of(tokenizer)`` gives
    a tokenizer's ``(texts, correct)`` or None where it cannot key them,
    ``convert(tokenizer, ids)`` gives the texts of ids met for the first
    time (the patch's: vLLM's ``convert_ids_list_to_tokens``), ``kinds`` is
    ``(Logprob, FlatLogprobs)``."""
    global _stock, _entry_of, _convert, _kinds, _last_tokenizer, _last_entry
    if not callable(stock):
        raise TypeError(f"stock must be callable, got {type(stock).__name__}")
    if not callable(entry_of):
        raise TypeError(f"entry_of must be callable, got {type(entry_of).__name__}")
    if not callable(convert):
        raise TypeError(f"convert must be callable, got {type(convert).__name__}")
    if len(kinds) != 2:
        raise ValueError(f"kinds must be (Logprob, FlatLogprobs), got {len(kinds)} items")
    _stock, _entry_of, _convert, _kinds = stock, entry_of, convert, kinds
    _last_tokenizer = _last_entry = None


def update(self, logprobs_lists):
    """fastbatch's ``LogprobsProcessor._update_sample_logprobs`` (vLLM's
    signature): ``update_sample_logprobs`` with the processor's tokenizer's
    table and corrector; vLLM's method (``bind``) where the tokenizer cannot
    key a table, or the call raises TypeError or ValueError (raised before
    anything is written)."""
    global _last_tokenizer, _last_entry
    if _stock is None:
        raise RuntimeError("fastbatch's update_sample_logprobs is not bound to vLLM's method "
                           "(fastbatch.patches.update_sample_logprobs.bind() does it)")
    tokenizer = self.tokenizer
    if tokenizer is not None and _last_tokenizer is not None and _last_tokenizer() is tokenizer:
        entry = _last_entry
    else:
        entry = _entry_of(tokenizer)
        if entry is not None and tokenizer is not None:
            _last_tokenizer, _last_entry = weakref.ref(tokenizer), entry
    if entry is not None:
        texts, correct = entry
        try:
            update_sample_logprobs(self, logprobs_lists, texts, _convert, _kinds, correct)
            return None
        except (TypeError, ValueError):  # checked before anything was written
            pass
    return _stock(self, logprobs_lists)


def update_sample_logprobs(processor, logprobs_lists, dict texts not None, convert,
                           tuple kinds not None, correct=None):
    """Append the positions of ``logprobs_lists`` to ``processor.logprobs``
    and their sampled logprobs to ``processor.cumulative_logprob``.

    vLLM's ``LogprobsProcessor._update_sample_logprobs(logprobs_lists)``
    (vLLM 0.32.0 on) on the processor's instance dict.  ``logprobs_lists``
    is its ``(token ids [P, K], logprobs [P, K], sampled ranks [P], _)``;
    ``texts`` maps token ids to their text for the processor's tokenizer
    (filled here from ``convert(tokenizer, [id])``, vLLM's
    ``convert_ids_list_to_tokens``; unused without a tokenizer); ``kinds`` is
    ``(Logprob, FlatLogprobs)``.  A text that ends in U+FFFD is replaced by
    ``correct(processor, token, context)``, or without it the processor's
    own ``_correct_decoded_token``, as vLLM's ``_verify_tokens`` does, for every
    entry kept (vLLM also corrects the columns beyond a request's
    ``num_logprobs + 1`` that it then drops, and in a dict a sampled token's
    own entry where a later column repeats it and replaces its text).  The
    entries, zipped with the ranks ``(rank, 1..num_logprobs)``, are appended
    as a dict of ``Logprob`` or to the ``FlatLogprobs``.

    Anything this call cannot take as vLLM would (another container or
    dtype, no column, a non-float cumulative logprob...) is a TypeError or
    ValueError, raised before anything is written; every text is found
    before anything is written too.  Returns the number of positions
    appended.
    """
    global _calls, _positions, _corrected
    if len(kinds) != 2:
        raise ValueError(f"kinds must be (Logprob, FlatLogprobs), got {len(kinds)} items")
    logprob_type, flat_type = kinds
    attrs = getattr(processor, "__dict__", None)
    if type(attrs) is not dict:
        raise TypeError(f"processor must have an instance dict, got "
                        f"{type(processor).__name__}")
    num_logprobs = (<dict>attrs).get("num_logprobs")
    container = (<dict>attrs).get("logprobs")
    cumulative = (<dict>attrs).get("cumulative_logprob")
    tokenizer = (<dict>attrs).get("tokenizer")
    if not PyLong_CheckExact(<PyObject*>num_logprobs):
        raise TypeError(f"num_logprobs must be an int, got {type(num_logprobs).__name__}")
    if type(cumulative) is not float:
        raise TypeError(f"cumulative_logprob must be a float, got "
                        f"{type(cumulative).__name__}")
    cdef bint flat = type(container) is flat_type
    cdef list lists = None
    if flat:
        flat_attrs = getattr(container, "__dict__", None)
        if type(flat_attrs) is not dict:
            raise TypeError("the FlatLogprobs must have an instance dict")
        lists = [(<dict>flat_attrs).get(name) for name in FLAT_LISTS]
        for name, item in zip(FLAT_LISTS, lists):
            if type(item) is not list:
                raise TypeError(f"FlatLogprobs.{name} must be a list, got "
                                f"{type(item).__name__}")
    elif type(container) is not list:
        raise TypeError(f"logprobs must be a list or FlatLogprobs, got "
                        f"{type(container).__name__}")
    if not isinstance(logprobs_lists, tuple) or PyTuple_GET_SIZE(logprobs_lists) != 4:
        raise TypeError("logprobs_lists must be a 4-tuple (token ids, logprobs, ranks, _)")
    cdef int overflow = 0
    cdef long long wanted = PyLong_AsLongLongAndOverflow(<PyObject*>num_logprobs, &overflow)
    if overflow:
        raise ValueError(f"num_logprobs = {num_logprobs} is out of range")

    cdef Py_buffer id_buffer, logprob_buffer, rank_buffer
    cdef Array token_ids, logprobs, ranks
    cdef bint held_ids = False, held_logprobs = False, held_ranks = False
    cdef Py_ssize_t num_positions, kept, num_ranks, p, c
    cdef bint leaves = True, placed = False
    cdef bint plain = not flat and _plain_dataclass(logprob_type)
    cdef double total
    cdef PyObject** table = token_table()
    cdef list decoded
    cdef object token, text, context, rank, entry, value, logprob
    try:
        held_ids = _view(<object>PyTuple_GET_ITEM(logprobs_lists, 0), &id_buffer,
                         &token_ids, 2, b"i", "logprobs_lists[0] (token ids)")
        held_logprobs = _view(<object>PyTuple_GET_ITEM(logprobs_lists, 1), &logprob_buffer,
                              &logprobs, 2, b"f", "logprobs_lists[1] (logprobs)")
        held_ranks = _view(<object>PyTuple_GET_ITEM(logprobs_lists, 2), &rank_buffer,
                           &ranks, 1, b"i", "logprobs_lists[2] (sampled ranks)")
        # vLLM zips the three per position, and per entry the ids, the
        # logprobs and the ranks: (rank,) then 1..num_logprobs (-1: all).
        num_positions = min(token_ids.rows, logprobs.rows, ranks.rows)
        num_ranks = 1 + max(0, logprobs.cols if wanted == -1 else wanted)
        kept = min(token_ids.cols, logprobs.cols, num_ranks)
        if num_positions > 0 and (token_ids.cols == 0 or logprobs.cols == 0):
            raise ValueError("logprobs_lists has no column: no sampled token")

        # Pass 1: every text kept (nothing of the processor is written).  In
        # a dict, a sampled token that a later column repeats keeps only that
        # column's text: vLLM's correction of its own is computed and dropped
        # (it has no effect), so it is not made here.
        decoded = [None] * (num_positions * kept)
        if tokenizer is not None:
            for p in range(num_positions):
                context = None
                for c in range(kept):
                    if c == 0 and not flat and _sampled_again(&token_ids, p, kept):
                        continue
                    token = _token(table, _int_at(&token_ids, p, c))
                    text = _text(texts, convert, tokenizer, token)
                    if _unfinished(text):
                        if context is None:
                            context = _context(processor, container, &token_ids, p)
                        if correct is None:
                            text = processor._correct_decoded_token(token, context)
                        else:
                            text = correct(processor, token, context)
                        _corrected += 1
                    decoded[p * kept + c] = text
        # Pass 2: append each position and add its sampled logprob.
        total = PyFloat_AS_DOUBLE(cumulative)
        for p in range(num_positions):
            total += _float_at(&logprobs, p, 0)
            rank = _int_at(&ranks, p, 0)
            if flat:
                (<list>lists[0]).append(PyList_GET_SIZE(lists[3]))
            else:
                entry = {}
                leaves = True
                placed = _sampled_again(&token_ids, p, kept)
            for c in range(kept):
                token = _token(table, _int_at(&token_ids, p, c))
                if c == 0 and placed:
                    # Its place in the dict; the value is a later column's,
                    # as in vLLM's, whose Logprob of this column is replaced.
                    PyDict_SetItem(entry, token, None)
                    continue
                value = _float_at(&logprobs, p, c)
                text = <object>PyList_GET_ITEM(decoded, p * kept + c)
                if flat:
                    PyList_Append(lists[2], token)
                    PyList_Append(lists[3], value)
                    PyList_Append(lists[4], rank if c == 0 else c)
                    PyList_Append(lists[5], text)
                else:
                    logprob = _new_logprob(logprob_type, plain, value, rank if c == 0 else c,
                                           text)
                    if type(logprob) is logprob_type and PyObject_IS_GC(logprob):
                        # A float, an int and a str (or None): nothing for the
                        # collector to find in it (see the patch module).
                        PyObject_GC_UnTrack(<PyObject*>logprob)
                    else:
                        leaves = False
                    PyDict_SetItem(entry, token, logprob)
            if flat:
                (<list>lists[1]).append(PyList_GET_SIZE(lists[3]))
            else:
                if leaves:  # int keys, untracked values: as the collector leaves such dicts
                    PyObject_GC_UnTrack(<PyObject*>entry)
                PyList_Append(container, entry)
        (<dict>attrs)["cumulative_logprob"] = total
        _calls += 1
        _positions += num_positions
        return num_positions
    finally:
        if held_ranks:
            PyBuffer_Release(&rank_buffer)
        if held_logprobs:
            PyBuffer_Release(&logprob_buffer)
        if held_ids:
            PyBuffer_Release(&id_buffer)
