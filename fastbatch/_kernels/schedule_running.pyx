# Compiler directives are set in setup.py (one place, with a debug switch).
"""Compiled piece ``schedule_running``: the running-request loop of vLLM's
``Scheduler.schedule`` for the requests it can take.

The same effects, checks and counters as ``fastbatch._reference.schedule_running``
(see its module note): requests are taken from ``req_index`` on, in order,
while each is one the loop can follow; at the first that is not, it returns,
and vLLM's own loop goes on from there with the locals returned.  The KV
slots come from ``allocate_slots``' plan (``allocate_decode``): a request
whose allocation vLLM's method must do is never started here, and one whose
``allocate_slots`` call returned None is left to vLLM's loop, which asks again
(the call changed nothing) and stalls or preempts as it does.
"""

__all__ = ["schedule_running_requests"]

from cpython.method cimport PyMethod_Check, PyMethod_GET_FUNCTION, PyMethod_GET_SELF
from libc.stdint cimport uint64_t

from fastbatch._kernels._common cimport RequestPrefetch, as_index

cdef object _MISSING = object()
from fastbatch._kernels.allocate_slots cimport _Manager, allocate_decode, manager_view

cdef uint64_t _requests = 0
cdef uint64_t _skipped = 0
cdef uint64_t _handed_over = 0


def stats():
    """This piece's counters since import or the last ``reset_stats()``."""
    return {"requests": _requests, "skipped": _skipped, "handed_over": _handed_over}


def reset_stats():
    """Set every counter of ``stats()`` back to zero."""
    global _requests, _skipped, _handed_over
    _requests = _skipped = _handed_over = 0


def schedule_running_requests(scheduler, req_index, token_budget, input_budget, draft_slots,
                              long_prefill_token_threshold, defer_prefills, prefill_scheduled,
                              drafts_needed, scheduled_running_reqs, req_to_new_blocks,
                              num_scheduled_tokens, scheduled_spec_decode_tokens, kinds):
    """vLLM's running-request loop from ``req_index`` for the requests it can
    take; ``(req_index, token_budget, input_budget, prefill_scheduled,
    drafts_needed)`` as the loop leaves them (``drafts_needed`` None: vLLM
    0.32.0's loop, which has none).  ``kinds``: ``(Request, the
    allocate_slots piece's method, the type of Request._all_token_ids
    besides list, the allocate_slots functions whose None changes
    nothing)``.
    """
    global _requests, _skipped, _handed_over
    cdef Py_ssize_t index, budget, inputs, slots, threshold, current_step, max_model_len
    cdef Py_ssize_t sampled_per_step, prefill_lookahead, placeholders, computed
    cdef Py_ssize_t prompt_tokens, max_tokens = 0, eligible_step, num_new
    cdef Py_ssize_t num_tokens, remaining, spec_count, num_spec, lookahead
    cdef bint any_prefill, unused, direct
    cdef dict attrs
    unchanged = (req_index, token_budget, input_budget, prefill_scheduled, drafts_needed)
    if type(kinds) is not tuple or len(<tuple>kinds) != 4:
        raise TypeError("kinds must be a tuple (Request, allocate_slots, token store type, "
                        "trusted allocate_slots functions)")
    request_type, kernel, token_store, trusted = <tuple>kinds
    if not isinstance(token_store, type) or type(trusted) is not tuple:
        raise TypeError("kinds must be a tuple (Request, allocate_slots, token store type, "
                        "trusted allocate_slots functions)")
    if not (as_index(req_index, &index) and as_index(token_budget, &budget)
            and as_index(input_budget, &inputs) and as_index(draft_slots, &slots)
            and as_index(long_prefill_token_threshold, &threshold)):
        return unchanged
    if (type(defer_prefills) is not bool or type(prefill_scheduled) is not bool
            or not (drafts_needed is None or type(drafts_needed) is bool)
            or type(scheduled_running_reqs) is not list or type(req_to_new_blocks) is not dict
            or type(num_scheduled_tokens) is not dict
            or type(scheduled_spec_decode_tokens) is not dict):
        return unchanged
    running = scheduler.running
    if type(running) is not list:
        return unchanged
    if not (index < len(<list>running) and budget > 0):
        return unchanged  # vLLM's loop reads nothing more of the scheduler
    # What vLLM's loop reads of the scheduler only on some paths: one the
    # scheduler lacks leaves the loop to vLLM's (which may never read it).
    if (getattr(scheduler, "ec_connector", _MISSING) is not None
            or getattr(scheduler, "need_mamba_block_aligned_split", _MISSING) is not False):
        return unchanged
    if not (as_index(getattr(scheduler, "current_step", None), &current_step)
            and as_index(getattr(scheduler, "max_model_len", None), &max_model_len)
            and as_index(getattr(scheduler, "num_sampled_tokens_per_step", None),
                         &sampled_per_step)
            and as_index(getattr(scheduler, "num_prefill_lookahead", None),
                         &prefill_lookahead)):
        return unchanged
    lookahead_tokens = getattr(scheduler, "num_lookahead_tokens", None)
    if not (as_index(lookahead_tokens, &lookahead) and lookahead >= 0):
        return unchanged
    manager = getattr(scheduler, "kv_cache_manager", None)
    allocate = getattr(manager, "allocate_slots", None)
    # The compiled allocate_slots bound to this manager: its planned call
    # directly.  vLLM's own method or fastbatch's FASTBATCH_VERIFY check of
    # the compiled one (``trusted``, or marked ``__fastbatch__``), bound to
    # it: called as vLLM calls it, only for a call the plan takes; a None
    # from it changed nothing, and vLLM's loop asks again.  Anything else (a
    # wrapper, a mock, another plugin's method): vLLM's loop makes every call.
    if not (PyMethod_Check(allocate) and <object>PyMethod_GET_SELF(allocate) is manager):
        return unchanged
    function = <object>PyMethod_GET_FUNCTION(allocate)
    direct = function is kernel
    if not direct and not _trusted(function, <tuple>trusted):
        return unchanged
    # What allocate_slots' plan reads of the manager, once for the loop: a
    # manager it cannot plan for leaves every request to vLLM's loop.
    cdef _Manager view = manager_view(manager)
    if view is None:
        return unchanged
    any_prefill = prefill_scheduled
    # The requests ahead of the loop, prefetched (after a forward pass their
    # memory is cold): the first ones now, then one more each turn.
    cdef RequestPrefetch prefetch = RequestPrefetch(request_type)
    prefetch.start_in_list(<list>running, index)
    while index < len(<list>running) and budget > 0:
        prefetch.advance_in_list(<list>running, index)
        request = (<list>running)[index]
        if inputs <= slots or type(request) is not request_type:
            break
        # Its attributes are read through its instance dict (each a plain
        # instance attribute of Request: checked on activation); one missing
        # reads as None and hands the request to vLLM's loop.
        instance_dict = request.__dict__
        if type(instance_dict) is not dict:
            break
        attrs = <dict>instance_dict
        if not (as_index(attrs.get("num_output_placeholders"), &placeholders)
                and as_index(attrs.get("num_computed_tokens"), &computed)):
            break
        if placeholders > 0:
            # Async scheduling: the step that reaches max_tokens is in flight.
            if not (as_index(attrs.get("num_prompt_tokens"), &prompt_tokens)
                    and as_index(attrs.get("max_tokens"), &max_tokens)):
                break
            if computed + 2 - placeholders >= prompt_tokens + max_tokens:
                index += 1
                _skipped += 1
                continue
        if not as_index(attrs.get("next_decode_eligible_step"), &eligible_step):
            break
        if current_step < eligible_step:
            index += 1
            _skipped += 1
            continue
        is_prefill_chunk = attrs.get("is_prefill_chunk")
        if type(is_prefill_chunk) is not bool:
            break
        if defer_prefills and is_prefill_chunk:
            index += 1
            _skipped += 1
            continue
        token_ids = attrs.get("_all_token_ids")
        spec_token_ids = attrs.get("spec_token_ids")
        if type(spec_token_ids) is not list:
            break
        # Request.num_tokens: len(_all_token_ids), a list or (vLLM 0.34.0) a
        # TokenBuffer, an array('i') whose length is the array's.
        if type(token_ids) is list:
            num_tokens = len(<list>token_ids)
        elif type(token_ids) is token_store:
            num_tokens = len(token_ids)
        else:
            break
        num_new = num_tokens + len(<list>spec_token_ids) + placeholders - computed
        if 0 < threshold < num_new:
            num_new = threshold
        num_new = min(num_new, budget, inputs - slots)
        num_new = min(num_new, max_model_len - computed - sampled_per_step)
        # Request.has_encoder_inputs (num_encoder_inputs = len(mm_features) > 0):
        # encoder inputs go to vLLM's loop.
        mm_features = attrs.get("mm_features")
        if type(mm_features) is not list or len(<list>mm_features) > 0:
            break
        # Scheduler._reserve_prefill_lookahead.
        remaining = num_tokens - computed - num_new
        if 0 < remaining < prefill_lookahead:
            num_new -= prefill_lookahead - remaining
        num_new = max(num_new, 0)
        if num_new == 0:
            index += 1
            _skipped += 1
            continue
        output_token_ids = attrs.get("_output_token_ids")
        request_id = attrs.get("request_id")
        if type(request_id) is not str:
            break
        if drafts_needed is not None and (
                type(output_token_ids) is not list
                or not as_index(attrs.get("max_tokens"), &max_tokens)):
            break
        if direct:
            new_blocks = allocate_decode(view, request, num_new, lookahead, True)
            if new_blocks is None:
                break  # vLLM's method allocates (or preempts) in vLLM's loop
        else:
            if allocate_decode(view, request, num_new, lookahead, False) is None:
                break
            new_blocks = allocate(request, num_new, num_lookahead_tokens=lookahead_tokens)
            if new_blocks is None:
                # What the call returned, not the plan: no slots.  The call
                # changed nothing; vLLM's loop asks again and stalls or preempts.
                break
        # Scheduled: nothing below can fail.
        _requests += 1
        (<list>scheduled_running_reqs).append(request)
        any_prefill = any_prefill or is_prefill_chunk
        (<dict>req_to_new_blocks)[request_id] = new_blocks
        (<dict>num_scheduled_tokens)[request_id] = num_new
        budget -= num_new
        inputs -= num_new + slots
        index += 1
        if drafts_needed is False:
            # not Scheduler._drafts_unused(request, computed, num_new)
            if computed + num_new < num_tokens:
                unused = True
            else:
                unused = (len(<list>output_token_ids) + 1 + (placeholders > 0)
                          >= max_tokens)
            drafts_needed = not unused
        if spec_token_ids:
            num_spec = num_new + computed - num_tokens - placeholders
            if num_spec > 0:
                spec_count = len(<list>spec_token_ids)
                if spec_count > num_spec:
                    spec_token_ids = (<list>spec_token_ids)[:num_spec]
                (<dict>scheduled_spec_decode_tokens)[request_id] = spec_token_ids
            attrs["spec_token_ids"] = []
    if index < len(<list>running) and budget > 0 and inputs > slots:
        _handed_over += 1
    return index, budget, inputs, any_prefill, drafts_needed


cdef bint _trusted(object function, tuple trusted):
    """Whether ``function`` is one of ``trusted`` (vLLM's own allocate_slots) or
    fastbatch's FASTBATCH_VERIFY check (``__fastbatch__`` True)."""
    for known in trusted:
        if function is known:
            return True
    return getattr(function, "__fastbatch__", False) is True
