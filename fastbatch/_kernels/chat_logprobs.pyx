# Compiler directives are set in setup.py (one place, with a debug switch).
"""Compiled piece ``chat_logprobs``: vLLM's
``OpenAIServingChat._create_chat_logprobs``, which builds the ``logprobs``
object of a chat completion (one ``ChatCompletionLogProbsContent`` per
generated token, each with its ``top_logprobs``) in the API server.

The pydantic models are built as pydantic-core builds a validated one:
the instance made by ``object.__new__``, then its field values (in field
order), the set of fields given, no extra fields and no private state.  The
values are exactly those validation would keep: exact ``str`` texts, exact
``float`` logprobs, new lists of ``int`` for the bytes; anything else is a
TypeError, and the caller runs vLLM's method.  ``fastbatch._reference``
holds the same behaviour in plain Python.
"""

__all__ = ["create_chat_logprobs"]

from cpython.dict cimport PyDict_Next
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE, PyList_New
from cpython.object cimport PyObject, PyObject_GenericSetAttr
from cpython.set cimport PySet_New
from libc.stdint cimport uint64_t

from fastbatch._kernels._common cimport (
    PyDict_GetItemWithError,
    PyLong_CheckExact,
    Py_INCREF,
    list_set_item,
)
from fastbatch._kernels._common cimport (
    PyBytes_AS_STRING, PyBytes_GET_SIZE, PyLong_FromLong, PyObject_GC_UnTrack,
    PyUnicode_AsEncodedString)

# Process-wide counters, read with stats().
cdef uint64_t _calls = 0
cdef uint64_t _positions = 0
cdef uint64_t _decoded = 0

# What validation leaves on every model it builds.
cdef str DICT = "__dict__"
cdef str FIELDS_SET = "__pydantic_fields_set__"
cdef str EXTRA = "__pydantic_extra__"
cdef str PRIVATE = "__pydantic_private__"
# The fields a call gives (vLLM's keyword arguments), as pydantic records them.
cdef frozenset GIVEN_MISSING = frozenset(("token", "bytes"))
cdef frozenset GIVEN_CONTENT = frozenset(("token", "logprob", "bytes", "top_logprobs"))
cdef frozenset GIVEN_TOP = frozenset(("token", "logprob", "bytes"))
cdef frozenset GIVEN_LOGPROBS = frozenset(("content",))
# ChatCompletionLogProb.logprob's floor (vLLM's ``max(logprob, -9999.0)``)
# and default.
cdef double FLOOR = -9999.0
cdef object FLOOR_VALUE = -9999.0
cdef object new_instance = object.__new__


def stats():
    """This piece's counters since import or the last ``reset_stats()``:
    ``calls``, ``positions`` (tokens) built, and texts ``decoded`` by the
    tokenizer (an entry with no decoded token, a token with no entry)."""
    return {"calls": _calls, "positions": _positions, "decoded": _decoded}


def reset_stats():
    """Set every counter of ``stats()`` back to zero."""
    global _calls, _positions, _decoded
    _calls = _positions = _decoded = 0


cdef object _model(object cls, dict values, frozenset given, bint leaf):
    """An instance of the pydantic model ``cls`` as validation leaves it
    (``leaf``: its values are atomic, or untracked lists of ints)."""
    instance = new_instance(cls)
    if leaf:
        PyObject_GC_UnTrack(<PyObject*>values)
    PyObject_GenericSetAttr(instance, DICT, values)
    fields_set = PySet_New(given)
    PyObject_GC_UnTrack(<PyObject*>fields_set)  # str items only
    PyObject_GenericSetAttr(instance, FIELDS_SET, fields_set)
    PyObject_GenericSetAttr(instance, EXTRA, {})
    PyObject_GenericSetAttr(instance, PRIVATE, None)
    return instance


cdef list _utf8(object text):
    """vLLM's ``list(text.encode("utf-8", errors="replace"))``."""
    data = PyUnicode_AsEncodedString(text, b"utf-8", b"replace")
    cdef const unsigned char* raw = <const unsigned char*>PyBytes_AS_STRING(data)
    cdef Py_ssize_t size = PyBytes_GET_SIZE(data), i
    cdef list result = PyList_New(size)
    for i in range(size):
        list_set_item(<PyObject*>result, i, PyLong_FromLong(raw[i]))  # small ints: shared
    PyObject_GC_UnTrack(<PyObject*>result)  # int items only
    return result


cdef object _exact_text(object text, str what):
    if type(text) is not str:
        raise TypeError(f"{what} must be a str, got {type(text).__name__}")
    return text


cdef object _decode(object tokenizer, object ids):
    """``tokenizer.decode(ids)`` (vLLM's call), which must give a str."""
    global _decoded
    if tokenizer is None:
        raise ValueError("no tokenizer to decode with")
    _decoded += 1
    return _exact_text(tokenizer.decode(ids), "the tokenizer's decode")


cdef object _logprob_value(object logprob):
    """vLLM's ``max(logprob.logprob, -9999.0)`` for an exact float."""
    value = logprob.logprob
    if type(value) is not float:
        raise TypeError(f"Logprob.logprob must be a float, got {type(value).__name__}")
    return FLOOR_VALUE if FLOOR > <double>value else value


cdef object _decoded_token(object logprob, object token_id, object tokenizer,
                           bint as_token_id):
    """vLLM's ``_get_decoded_token(logprob, token_id, tokenizer, as_token_id)``."""
    if as_token_id:
        return f"token_id:{token_id}"
    text = logprob.decoded_token
    if text is not None:
        return _exact_text(text, "Logprob.decoded_token")
    return _decode(tokenizer, [token_id])


def create_chat_logprobs(object token_ids, object top_logprobs, object tokenizer,
                         object limit, bint as_token_id, tuple kinds not None):
    """The ``ChatCompletionLogProbs`` of ``token_ids``.

    vLLM's ``OpenAIServingChat._create_chat_logprobs(token_ids, top_logprobs,
    tokenizer, ...)`` (vLLM 0.30.0 on), with the number of ``top_logprobs``
    entries per position already worked out as ``limit`` (None: all, else an
    int >= 0: the first ``limit`` of the position's dict) and
    ``return_as_token_id`` as ``as_token_id``.  ``kinds`` is
    ``(ChatCompletionLogProb, ChatCompletionLogProbsContent,
    ChatCompletionLogProbs)``.

    ``token_ids`` must be a list or tuple of ints, each item of
    ``top_logprobs`` (``top_logprobs[i]``) None or a dict of ``Logprob``;
    texts must be exact strs and logprobs exact floats.  Anything else is a
    TypeError (a position with no entry and no tokenizer: a ValueError);
    nothing outside the returned objects is written.
    """
    global _calls, _positions
    if len(kinds) != 3:
        raise ValueError(f"kinds must be (ChatCompletionLogProb, "
                         f"ChatCompletionLogProbsContent, ChatCompletionLogProbs), got "
                         f"{len(kinds)} items")
    top_type, content_type, logprobs_type = kinds
    if type(token_ids) is not list and type(token_ids) is not tuple:
        raise TypeError(f"token_ids must be a list or tuple, got {type(token_ids).__name__}")
    cdef tuple ids = tuple(token_ids)  # read as it is now, whatever the calls below do
    cdef Py_ssize_t count = -1
    if limit is not None:
        if not PyLong_CheckExact(<PyObject*>limit) or limit < 0:
            raise TypeError(f"limit must be None or an int >= 0, got {limit!r}")
        count = limit
    cdef bint listed = type(top_logprobs) is list
    cdef Py_ssize_t i, n = len(ids), taken, pos
    cdef PyObject* found
    cdef PyObject* key
    cdef PyObject* value
    cdef list content = PyList_New(n)
    cdef list tops
    for i in range(n):
        token_id = ids[i]
        if not PyLong_CheckExact(<PyObject*>token_id):
            raise TypeError(f"token_ids[{i}] must be an int, got {type(token_id).__name__}")
        if listed:
            if i >= PyList_GET_SIZE(top_logprobs):
                raise TypeError(f"top_logprobs has {PyList_GET_SIZE(top_logprobs)} "
                                f"positions, token_ids {n}")
            step = <object>PyList_GET_ITEM(top_logprobs, i)
        else:
            step = top_logprobs[i]
        found = NULL
        if step is not None:
            if type(step) is not dict:
                raise TypeError(f"top_logprobs[{i}] must be a dict or None, got "
                                f"{type(step).__name__}")
            found = PyDict_GetItemWithError(<PyObject*>step, <PyObject*>token_id)
        if found == NULL or <object>found is None:
            # No entry for the token: its text alone, no logprob.
            if as_token_id:
                token = f"token_id:{token_id}"
            else:
                token = _decode(tokenizer, token_id)
            item = _model(content_type, {"token": token, "logprob": FLOOR_VALUE,
                                         "bytes": _utf8(token), "top_logprobs": []},
                          GIVEN_MISSING, False)
        else:
            entry = <object>found
            step_decoded = entry.decoded_token
            if step_decoded is not None:
                _exact_text(step_decoded, "Logprob.decoded_token")
            token = _decoded_token(entry, token_id, tokenizer, as_token_id)
            value_object = _logprob_value(entry)
            tops = []
            taken = 0
            key = value = NULL
            pos = 0
            while (count < 0 or taken < count) and PyDict_Next(step, &pos, &key, &value):
                top_token = _decoded_token(<object>value, <object>key, tokenizer, as_token_id)
                tops.append(_model(top_type, {"token": top_token,
                                              "logprob": _logprob_value(<object>value),
                                              "bytes": _utf8(top_token)}, GIVEN_TOP, True))
                taken += 1
            item = _model(content_type, {
                "token": token, "logprob": value_object,
                "bytes": None if step_decoded is None else _utf8(step_decoded),
                "top_logprobs": tops}, GIVEN_CONTENT, False)
        Py_INCREF(<PyObject*>item)
        list_set_item(<PyObject*>content, i, <PyObject*>item)
    _calls += 1
    _positions += n
    return _model(logprobs_type, {"content": content}, GIVEN_LOGPROBS, False)
