# Compiler directives are set in setup.py (one place, with a debug switch).
"""Compiled piece ``after_schedule``: the per-request loops of vLLM's
``Scheduler._update_after_schedule`` and ``AsyncScheduler._update_after_schedule``.

The same effects, checks and counters as ``fastbatch._reference.after_schedule``
(see its module note): a first pass checks the whole batch and collects the
requests, the second applies both loops' effects per request.  The ints are
added as Python ints (exact at any size); the flags are set once, after the
pass, to the value vLLM's ``|=`` leaves.  A request's attributes are read and
written through its instance dict (the patch's activation check confirms
that each is a plain instance attribute of vLLM's ``Request``), which spares
each access the type's attribute lookup.  A request's token store is a list
(vLLM up to 0.33.0) or an ``array.array`` whose type keeps array's own
``__len__`` (vLLM 0.34.0's ``TokenBuffer``); only its length is read, with
``len()`` as vLLM's ``Request.num_tokens`` does.
"""

__all__ = ["update_after_schedule"]

from array import array as _array

from libc.stdint cimport uint64_t

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


cdef list _plain_batch(object scheduler, object scheduler_output, bint is_async,
                       bint always_eligible, object request_type):
    """The scheduled requests in order, or None if anything is not as vLLM keeps it."""
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
    for req_id, num_tokens in (<dict>num_scheduled).items():
        if type(req_id) is not str:
            return None
        request = (<dict>requests).get(req_id)
        if type(request) is not request_type or type(num_tokens) is not int:
            return None
        instance_dict = request.__dict__
        if type(instance_dict) is not dict:
            return None
        attrs = <dict>instance_dict
        if (type(attrs.get("num_computed_tokens")) is not int
                or type(attrs.get("num_in_flight_tokens")) is not int
                or type(attrs.get("num_output_placeholders")) is not int
                or "structured_output_request" not in attrs):
            return None
        token_type = type(attrs.get("_all_token_ids"))
        if token_type is not list and token_type is not array_type:
            if not _plain_token_array(token_type):
                return None
            array_type = token_type
        request_id = attrs.get("request_id")
        if type(request_id) is not str or <str>request_id != <str>req_id:
            return None
        if is_async:
            spec = (<dict>spec_tokens).get(req_id)
            if spec is not None and type(spec) is not list:
                return None
        batch.append(attrs)
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
    cdef list batch = _plain_batch(scheduler, scheduler_output, is_async, always, request_type)
    if batch is None:
        _stock_calls += 1
        return False
    if not batch:
        return True
    cdef dict num_scheduled = scheduler_output.num_scheduled_tokens
    cdef bint defer = scheduler.defer_block_free is True
    step_seq = scheduler.sched_step_seq if defer else None
    cdef set inflight_prefills = scheduler._inflight_prefills
    cdef dict requests = scheduler.requests
    cdef bint has_structured = scheduler_output.has_structured_output_requests is True
    cdef bint pending_structured = False
    cdef bint use_v2 = False
    cdef bint prefill_chunk, structured
    cdef dict spec_tokens = None
    per_step = current_step = stagger = None
    if is_async:
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        pending_structured = scheduler_output.pending_structured_output_tokens is True
        per_step = scheduler.num_sampled_tokens_per_step
        use_v2 = always or scheduler.use_v2_model_runner is True
        if use_v2:
            current_step, stagger = scheduler.current_step, scheduler.decode_stagger
    cdef Py_ssize_t index = 0
    cdef dict attrs
    for req_id, num_tokens in num_scheduled.items():
        attrs = <dict>batch[index]
        index += 1
        computed = attrs["num_computed_tokens"] + num_tokens
        attrs["num_computed_tokens"] = computed
        attrs["num_in_flight_tokens"] = attrs["num_in_flight_tokens"] + num_tokens
        if defer:
            attrs["last_sched_seq"] = step_seq
        placeholders = attrs["num_output_placeholders"]
        tokens = attrs["_all_token_ids"]
        prefill_chunk = computed < (
            len(<list>tokens) if type(tokens) is list else len(tokens)) + placeholders
        attrs["is_prefill_chunk"] = prefill_chunk
        structured = attrs["structured_output_request"] is not None
        if structured and not prefill_chunk:
            has_structured = True
        if prefill_chunk:
            continue
        if inflight_prefills:
            inflight_prefills.discard(requests[req_id])
        if not is_async:
            continue
        if structured and placeholders > 0:
            pending_structured = True
        spec = spec_tokens.get(req_id)
        attrs["num_output_placeholders"] = placeholders + (
            per_step + (0 if spec is None else len(<list>spec)))
        attrs["spec_token_ids"] = spec_token_placeholders
        if use_v2:
            attrs["next_decode_eligible_step"] = current_step + stagger
    scheduler_output.has_structured_output_requests = has_structured
    if is_async:
        scheduler_output.pending_structured_output_tokens = pending_structured
    _requests += len(batch)
    return True
