# Compiler directives are set in setup.py (one place, with a debug switch).
"""Compiled piece ``after_schedule``: the per-request loops of vLLM's
``Scheduler._update_after_schedule`` and ``AsyncScheduler._update_after_schedule``.

The same effects, checks and counters as ``fastbatch._reference.after_schedule``
(see its module note): a first pass checks the whole batch and reads what
the loops read of each request (prefetching the requests ahead of it,
``ScheduledPrefetch``), the second only applies both loops' effects per
request from those reads (nothing runs in between that could change them),
without looking the attributes up again.  The ints are added as Python ints
(exact at any size); the flags are set once, after the pass, to the value
vLLM's ``|=`` leaves.  A request's attributes are read and written through
its instance dict (the patch's activation check confirms that each is a
plain instance attribute of vLLM's ``Request``), which spares each access
the type's attribute lookup.  A request's token store is a list
(vLLM up to 0.33.0) or an ``array.array`` whose type keeps array's own
``__len__`` (vLLM 0.34.0's ``TokenBuffer``); only its length is read, with
``len()`` as vLLM's ``Request.num_tokens`` does.
"""

__all__ = ["update_after_schedule"]

from array import array as _array

from cpython.list cimport PyList_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.object cimport PyObject
from libc.stdint cimport uint64_t

from fastbatch._kernels._common cimport (
    Py_None,
    PyDict_GetItemWithError,
    PyDict_Next,
    PyObject_GenericGetDict,
    ScheduledPrefetch,
)

cdef uint64_t _requests = 0
cdef uint64_t _stock_calls = 0


def stats():
    """This piece's counters since import or the last ``reset_stats()``."""
    return {"requests": _requests,
            "stock_calls": _stock_calls}


def reset_stats():
    """Set every counter of ``stats()`` back to zero."""
    global _requests, _stock_calls
    _requests = _stock_calls = 0


cdef bint _plain_token_array(type token_type) except -1:
    """Whether ``token_type`` is ``array.array`` or a subclass that keeps its
    ``__len__`` (what ``len()`` of a token store of that type gives is then
    the array's length)."""
    return issubclass(token_type, _array) and token_type.__len__ is _array.__len__


cdef struct Scheduled:
    # One scheduled request as the first pass read it (borrowed: ``batch``,
    # ``num_scheduled`` and the instance dicts hold them, and nothing changes
    # them before the second pass has used them).
    PyObject* req_id
    PyObject* num_tokens       # its scheduled token count (an int)
    PyObject* attrs            # its instance dict
    PyObject* computed         # num_computed_tokens (an int)
    PyObject* in_flight        # num_in_flight_tokens (an int)
    PyObject* placeholders     # num_output_placeholders (an int)
    PyObject* spec             # its scheduled spec ids (a list), or NULL (async only)
    Py_ssize_t num_all_tokens  # len(_all_token_ids)
    bint structured            # structured_output_request is not None


cdef inline PyObject* _peek(dict attrs, str name) except? NULL:
    """``attrs[name]`` borrowed, or NULL if it is missing."""
    return PyDict_GetItemWithError(<PyObject*>attrs, <PyObject*>name)


cdef list _plain_batch(object scheduler, object scheduler_output, bint is_async,
                       bint always_eligible, object request_type, Scheduled* read,
                       Py_ssize_t room):
    """The scheduled requests' instance dicts in order (each one's reads in
    ``read``, which has ``room`` for them), or None if anything is not as
    vLLM keeps it."""
    num_scheduled = scheduler_output.num_scheduled_tokens
    requests = scheduler.requests
    if (type(num_scheduled) is not dict or type(requests) is not dict
            or type(scheduler._inflight_prefills) is not set
            or type(scheduler_output.has_structured_output_requests) is not bool
            or type(scheduler.defer_block_free) is not bool):
        return None
    spec_tokens = None
    if is_async:
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        if (type(spec_tokens) is not dict
                or type(scheduler_output.pending_structured_output_tokens) is not bool
                or type(scheduler.num_sampled_tokens_per_step) is not int):
            return None
        use_v2 = True if always_eligible else scheduler.use_v2_model_runner
        if type(use_v2) is not bool:
            return None
        if use_v2 is True and (type(scheduler.current_step) is not int
                               or type(scheduler.decode_stagger) is not int):
            return None
    cdef list batch = []
    cdef dict attrs
    cdef type array_type = None  # a token-store type other than list, once accepted
    cdef Py_ssize_t pos = 0, index = 0
    cdef PyObject* key
    cdef PyObject* value
    cdef PyObject* item
    cdef PyObject* spec
    cdef Scheduled* this
    # The requests ahead of the loop, prefetched (ScheduledPrefetch).
    cdef ScheduledPrefetch prefetch = ScheduledPrefetch(<dict>num_scheduled, <dict>requests,
                                                        request_type)
    while PyDict_Next(<dict>num_scheduled, &pos, &key, &value):
        prefetch.advance(index)
        if index >= room or type(<object>key) is not str:
            return None
        request = (<dict>requests).get(<object>key)
        if type(request) is not request_type or type(<object>value) is not int:
            return None
        instance_dict = PyObject_GenericGetDict(request, NULL)
        if type(instance_dict) is not dict:
            return None
        attrs = <dict>instance_dict
        this = &read[index]
        this.req_id, this.num_tokens, this.attrs = key, value, <PyObject*>attrs
        this.computed = _peek(attrs, "num_computed_tokens")
        this.in_flight = _peek(attrs, "num_in_flight_tokens")
        this.placeholders = _peek(attrs, "num_output_placeholders")
        if (this.computed == NULL or type(<object>this.computed) is not int
                or this.in_flight == NULL or type(<object>this.in_flight) is not int
                or this.placeholders == NULL or type(<object>this.placeholders) is not int):
            return None
        item = _peek(attrs, "structured_output_request")
        if item == NULL:
            return None
        this.structured = item != Py_None
        item = _peek(attrs, "_all_token_ids")
        token_type = type(<object>item) if item != NULL else type(None)
        if token_type is list:
            this.num_all_tokens = PyList_GET_SIZE(<object>item)
        else:
            if token_type is not array_type:
                if not _plain_token_array(token_type):
                    return None
                array_type = token_type
            this.num_all_tokens = len(<object>item)
        item = _peek(attrs, "request_id")
        if item == NULL or type(<object>item) is not str or <str>item != <str>key:
            return None
        this.spec = NULL
        if is_async:
            spec = PyDict_GetItemWithError(<PyObject*>spec_tokens, key)
            if spec != NULL and spec != Py_None:
                if type(<object>spec) is not list:
                    return None
                this.spec = spec
        batch.append(attrs)
        index += 1
    return batch


def update_after_schedule(scheduler, scheduler_output, spec_token_placeholders,
                          request_type, *, always_eligible):
    """vLLM's per-request loop of ``Scheduler._update_after_schedule`` and,
    when ``spec_token_placeholders`` is a list, that of
    ``AsyncScheduler._update_after_schedule`` in the same pass.  True when
    done; False, with nothing changed, when the caller must run vLLM's method.

    ``request_type`` is vLLM's ``Request``.  ``always_eligible`` (async only):
    every decoding request gets ``next_decode_eligible_step`` (vLLM 0.34.0);
    False: only when ``scheduler.use_v2_model_runner`` (vLLM 0.31.0 to 0.33.0).
    """
    global _requests, _stock_calls
    if spec_token_placeholders is not None and type(spec_token_placeholders) is not list:
        raise TypeError("spec_token_placeholders must be a list or None, "
                        f"got {type(spec_token_placeholders).__name__}")
    if not isinstance(request_type, type):
        raise TypeError(f"request_type must be a class, got {type(request_type).__name__}")
    if type(always_eligible) is not bool:
        raise TypeError(f"always_eligible must be a bool, got {type(always_eligible).__name__}")
    cdef bint is_async = spec_token_placeholders is not None
    cdef bint always = always_eligible is True
    num_scheduled = scheduler_output.num_scheduled_tokens
    if type(num_scheduled) is not dict:
        _stock_calls += 1
        return False
    cdef Py_ssize_t num_requests = len(<dict>num_scheduled)
    cdef Scheduled* read = <Scheduled*>PyMem_Malloc(max(num_requests, 1) * sizeof(Scheduled))
    if read == NULL:
        raise MemoryError()
    try:
        batch = _plain_batch(scheduler, scheduler_output, is_async, always, request_type,
                             read, num_requests)
        if batch is None:
            _stock_calls += 1
            return False
        _after_schedule(scheduler, scheduler_output, spec_token_placeholders, is_async,
                        always, read, len(<list>batch))
    finally:
        PyMem_Free(read)
    _requests += len(<list>batch)
    return True


cdef int _after_schedule(object scheduler, object scheduler_output,
                         object spec_token_placeholders, bint is_async, bint always,
                         Scheduled* read, Py_ssize_t num_requests) except -1:
    """Both loops' effects on the requests read (``_plain_batch``)."""
    if num_requests == 0:
        return 0
    cdef bint defer = scheduler.defer_block_free is True
    step_seq = scheduler.sched_step_seq if defer else None
    cdef set inflight_prefills = scheduler._inflight_prefills
    cdef dict requests = scheduler.requests
    cdef bint has_structured = scheduler_output.has_structured_output_requests is True
    cdef bint pending_structured = False
    cdef bint use_v2 = False
    cdef bint prefill_chunk
    per_step = eligible_step = None
    if is_async:
        pending_structured = scheduler_output.pending_structured_output_tokens is True
        per_step = scheduler.num_sampled_tokens_per_step
        use_v2 = always or scheduler.use_v2_model_runner is True
        if use_v2:
            eligible_step = scheduler.current_step + scheduler.decode_stagger
    cdef Py_ssize_t index
    cdef Scheduled* this
    cdef dict attrs
    for index in range(num_requests):
        this = &read[index]
        attrs = <dict>this.attrs
        num_tokens = <object>this.num_tokens
        computed = <object>this.computed + num_tokens
        attrs["num_computed_tokens"] = computed
        attrs["num_in_flight_tokens"] = <object>this.in_flight + num_tokens
        if defer:
            attrs["last_sched_seq"] = step_seq
        placeholders = <object>this.placeholders
        prefill_chunk = computed < this.num_all_tokens + placeholders
        attrs["is_prefill_chunk"] = prefill_chunk
        if this.structured and not prefill_chunk:
            has_structured = True
        if prefill_chunk:
            continue
        if inflight_prefills:
            inflight_prefills.discard(requests[<object>this.req_id])
        if not is_async:
            continue
        if this.structured and placeholders > 0:
            pending_structured = True
        attrs["num_output_placeholders"] = placeholders + (
            per_step + (0 if this.spec == NULL else PyList_GET_SIZE(<object>this.spec)))
        attrs["spec_token_ids"] = spec_token_placeholders
        if use_v2:
            attrs["next_decode_eligible_step"] = eligible_step
    scheduler_output.has_structured_output_requests = has_structured
    if is_async:
        scheduler_output.pending_structured_output_tokens = pending_structured
    return 0
