# Compiler directives are set in setup.py (one place, with a debug switch).
"""Compiled piece ``detokenizer_update``: vLLM's
``BaseIncrementalDetokenizer.update`` for a ``FastIncrementalDetokenizer``.

Every attribute is read before anything is written; then vLLM's steps in
vLLM's order.  Each token's text is appended to ``output_text`` in place when
nothing else holds the string and it is long enough for that to beat a copy,
as CPython's own ``text += piece`` does for a local variable (vLLM's
``self.output_text += ...`` copies the whole text for every token).
``update`` is the method itself, bound on vLLM's class by the patch (a
Cython function binds like a Python one: ``binding`` is on, Cython 3's
default), with vLLM's signature: the compiled call for the detokenizers it
takes, vLLM's method (``bind``) for the rest, with no Python frame between
the output processor and the compiled loop.
``fastbatch._reference`` holds the same behaviour in plain Python.
"""

__all__ = ["update_detokenizer"]

from cpython.object cimport PyObject
from libc.stdint cimport uint64_t

from bisect import bisect_left

from fastbatch._kernels._common cimport Py_DECREF, Py_INCREF, Py_XDECREF
from fastbatch._kernels._common cimport (
    Py_REFCNT, PyNumber_InPlaceAdd, PyObject_SetAttr, PyUnicode_CheckExact, PyUnicode_Concat,
    PyUnicode_CopyCharacters, PyUnicode_GET_LENGTH, PyUnicode_IS_ASCII, PyUnicode_KIND,
    PyUnicode_Resize)


# Process-wide counters, read with stats().
cdef uint64_t _detokenizer_calls = 0
cdef uint64_t _detokenizer_tokens = 0
cdef uint64_t _detokenizer_stops = 0


def stats():
    """This piece's counters since import or the last ``reset_stats()``."""
    return {"calls": _detokenizer_calls,
            "tokens": _detokenizer_tokens,
            "stops": _detokenizer_stops}


def reset_stats():
    """Set every counter of ``stats()`` back to zero."""
    global _detokenizer_calls, _detokenizer_tokens, _detokenizer_stops
    _detokenizer_calls = _detokenizer_tokens = _detokenizer_stops = 0


cdef enum:
    # Texts at least this long are grown in place (where nothing else holds
    # them); a shorter one is cheaper to copy than to take off the
    # detokenizer and put back.
    IN_PLACE_MIN_LENGTH = 1024


cdef int _append(object detokenizer, PyObject** text, PyObject* piece) except -1:
    """``detokenizer.output_text = *text + piece`` (``*text`` an owned
    reference to the text the detokenizer holds, replaced by the result's),
    as vLLM's ``self.output_text += piece``.  A long exact str that only the
    detokenizer and this reference hold is taken off the detokenizer (the
    attribute set to None) and grown in place (``PyUnicode_Resize`` would
    copy one that is interned or hashed); anything else is Python's ``+=``.
    On failure the attribute and ``*text`` are as they were."""
    cdef Py_ssize_t length, extra
    cdef PyObject* result
    if PyUnicode_CheckExact(text[0]) and PyUnicode_CheckExact(piece):
        extra = PyUnicode_GET_LENGTH(piece)
        if extra == 0:
            return 0  # str += "" is the same str
        length = PyUnicode_GET_LENGTH(text[0])
        if (length >= IN_PLACE_MIN_LENGTH and Py_REFCNT(text[0]) == 2
                and PyUnicode_KIND(piece) <= PyUnicode_KIND(text[0])
                and (PyUnicode_IS_ASCII(piece) or not PyUnicode_IS_ASCII(text[0]))):
            PyObject_SetAttr(detokenizer, "output_text", None)  # its one reference is ours
            try:
                PyUnicode_Resize(text, length + extra)
                PyUnicode_CopyCharacters(text[0], length, piece, 0, extra)
            finally:
                PyObject_SetAttr(detokenizer, "output_text", <object>text[0])
            return 0
        result = PyUnicode_Concat(text[0], piece)
    else:
        result = PyNumber_InPlaceAdd(text[0], piece)
    try:
        PyObject_SetAttr(detokenizer, "output_text", <object>result)
    finally:
        Py_DECREF(text[0])
        text[0] = result
    return 0


# Set by bind(): vLLM's own method, the detokenizer type the compiled call
# takes, and the namespace vLLM's check_stop_strings is read from.
cdef object _stock = None
cdef object _taken = None
cdef dict _namespace = None


def bind(stock, taken, namespace):
    """Make ``update`` answer for this vLLM: ``stock`` is vLLM's own
    ``BaseIncrementalDetokenizer.update`` (it answers every call the compiled
    one does not take), ``taken`` the detokenizer type the compiled call takes
    (vLLM's ``FastIncrementalDetokenizer``), ``namespace`` the globals of
    vLLM's module, from which ``check_stop_strings`` is read at every call
    (as vLLM's method reads its global)."""
    global _stock, _taken, _namespace
    if not callable(stock):
        raise TypeError(f"stock must be callable, got {type(stock).__name__}")
    if not isinstance(taken, type):
        raise TypeError(f"taken must be a type, got {type(taken).__name__}")
    if type(namespace) is not dict:
        raise TypeError(f"namespace must be a dict, got {type(namespace).__name__}")
    _stock, _taken, _namespace = stock, taken, namespace


def update(self, new_token_ids, stop_terminated):
    """fastbatch's ``BaseIncrementalDetokenizer.update`` (vLLM's signature):
    ``update_detokenizer`` with vLLM's ``check_stop_strings`` for a
    detokenizer of exactly the type taken and ids in a list; vLLM's method
    (``bind``) with the same arguments for every other call."""
    if _stock is None:
        raise RuntimeError("fastbatch's detokenizer update is not bound to vLLM's method "
                           "(fastbatch.patches.detokenizer_update.bind() does it)")
    if type(self) is _taken and type(new_token_ids) is list:
        return _update(self, <list>new_token_ids, stop_terminated,
                       _namespace["check_stop_strings"])
    return _stock(self, new_token_ids, stop_terminated)


def update_detokenizer(detokenizer, list new_token_ids not None, stop_terminated,
                       check_stop_strings):
    """vLLM's ``BaseIncrementalDetokenizer.update(new_token_ids,
    stop_terminated)`` (vLLM 0.32.0 on) for a ``FastIncrementalDetokenizer``
    (whose ``num_output_tokens()`` is ``len(token_ids)``): each new token
    appended to ``token_ids`` and its text, ``detokenizer.decode_next(token_id)``
    (vLLM's own), to ``output_text``, while the detokenizer does not hold the
    text, so that CPython grows the string in place when nothing else holds it
    either; the last one not decoded when ``stop_terminated`` and the stop
    string is not kept; then, with stop strings, vLLM's ``check_stop_strings``
    (passed in) from the first token past ``min_tokens``, and the tokens after
    the match dropped and the text truncated as vLLM does.  Returns the stop
    string matched, or None.

    Its attributes are read as attributes (not through ``__dict__``, which
    would turn the instance's inline values into a dict and slow vLLM's own
    accesses to them), all before anything is written: ``token_ids``,
    ``output_text`` and ``stop``; with stop strings or ``stop_terminated``,
    ``include_stop_str_in_output``; with stop strings, ``min_tokens`` (where
    vLLM's method reads them).  AttributeError naming a missing one.  An
    exception from ``decode_next`` or ``check_stop_strings`` propagates with
    the detokenizer as vLLM's method leaves it (the token appended, the text
    up to the one before).
    """
    return _update(detokenizer, new_token_ids, stop_terminated, check_stop_strings)


cdef object _update(object detokenizer, list new_token_ids, object stop_terminated,
                    object check_stop_strings):
    """``update_detokenizer``'s work (``new_token_ids`` a list)."""
    global _detokenizer_calls, _detokenizer_tokens, _detokenizer_stops
    token_ids = detokenizer.token_ids
    output_text = detokenizer.output_text
    stop = detokenizer.stop
    cdef bint stopping = bool(stop)
    # read where vLLM reads them (but before anything is written)
    cdef bint terminated = bool(stop_terminated)
    include_stop = min_tokens = None
    if terminated or stopping:
        include_stop = detokenizer.include_stop_str_in_output
    if stopping:
        min_tokens = detokenizer.min_tokens
    _detokenizer_calls += 1
    cdef Py_ssize_t count = len(new_token_ids)
    if count == 0:
        return None
    skipped = None
    if terminated and not include_stop:
        skipped = new_token_ids[count - 1]
        count -= 1
    cdef Py_ssize_t num_prev_tokens = len(token_ids)
    cdef list token_offsets = [len(output_text)] if stopping else None
    cdef Py_ssize_t index
    cdef PyObject* text = <PyObject*>output_text  # owned below, as the loop's text
    Py_INCREF(text)
    output_text = None
    try:
        for index in range(count):
            if index >= len(new_token_ids):  # only if decode_next shortened the list
                break
            token_id = new_token_ids[index]
            token_ids.append(token_id)
            piece = detokenizer.decode_next(token_id)
            _append(detokenizer, &text, <PyObject*>piece)
            if token_offsets is not None:
                token_offsets.append(PyUnicode_GET_LENGTH(text)
                                     if PyUnicode_CheckExact(text) else len(<object>text))
            _detokenizer_tokens += 1
        output_text = <object>text
    finally:
        Py_XDECREF(text)
    if skipped is not None:
        token_ids.append(skipped)
        if token_offsets is not None:
            token_offsets.append(len(output_text))
    if token_offsets is None or not len(token_ids) > min_tokens:
        return None
    stop_check_offset = token_offsets[max(min_tokens - num_prev_tokens, 0)]
    found = check_stop_strings(output_text=output_text,
                               new_char_count=len(output_text) - stop_check_offset,
                               stop=stop, include_in_output=include_stop)
    if found is None:
        return None
    stop_string, truncate_to = found
    stop_end = len(output_text) if truncate_to == -1 else truncate_to
    if not include_stop:
        stop_end += len(stop_string)
    num_kept = bisect_left(token_offsets, stop_end, lo=1)
    del token_ids[num_prev_tokens + num_kept:]
    if truncate_to != -1:
        detokenizer.output_text = output_text[:truncate_to]
    _detokenizer_stops += 1
    return stop_string
