"""Pure-Python twin of the compiled piece ``schedule_running``
(``fastbatch._kernels.schedule_running``).

``schedule_running`` runs vLLM's running-request loop of
``Scheduler.schedule`` (vLLM 0.32.0 to 0.34.0: the same loop, and from 0.33.0
``drafts_needed``) from ``req_index`` on, for as long as each request is one
it can follow, and returns the loop's locals as it leaves them; at the first
request it cannot follow it returns at once, nothing done for that request,
and vLLM's own loop goes on from there (the patch puts this call before
vLLM's loop, whose state is all in those locals and the requests).  The loop
has no other state: ``req_index`` moves over ``scheduler.running``, the
budgets shrink, the scheduled requests, their blocks, token counts and
drafts are recorded in the four containers.

A request it follows, read off vLLM 0.33.0's and 0.34.0's code (the same
loop; pinned by the patch's guard), is a plain ``Request`` (exact type) whose
counters are exact ints:

- ``input_budget <= draft_slots`` ends vLLM's loop: it returns;
- skipped (``req_index += 1``): the async step that reaches ``max_tokens`` is
  in flight (``num_output_placeholders > 0`` and ``num_computed_tokens + 2 -
  num_output_placeholders >= num_prompt_tokens + max_tokens``); a request
  not yet eligible (``current_step < next_decode_eligible_step``); a prefill
  chunk while prefills are deferred; a request with 0 tokens to schedule;
- ``num_new_tokens = num_tokens_with_spec + num_output_placeholders -
  num_computed_tokens`` (``num_tokens_with_spec`` is
  ``len(_all_token_ids) + len(spec_token_ids)``), capped by
  ``long_prefill_token_threshold``, the budgets and ``max_model_len -
  num_computed_tokens - num_sampled_tokens_per_step``, then
  ``_reserve_prefill_lookahead``'s arithmetic;
- a request with encoder inputs (``has_encoder_inputs``: ``mm_features``
  not empty) goes to vLLM's
  loop, and so does the whole loop with an EC connector or Mamba's aligned
  split;
- the KV slots: ``kv_cache_manager.allocate_slots(request, num_new_tokens,
  num_lookahead_tokens=scheduler.num_lookahead_tokens)`` only where
  ``allocate_slots``' plan takes the call (its ``allocate_decode``, the
  twin's ``_allocate_decode``): then it
  cannot return None, and the preemption that None starts is never needed
  here; a call vLLM's method must make goes to vLLM's loop, not started.
  Where the manager's ``allocate_slots`` is the piece's own (``kinds[1]``
  bound to it), the planned call is made directly; where it is vLLM's own
  method (``kinds[3]``) or fastbatch's ``FASTBATCH_VERIFY`` check (a function
  marked ``__fastbatch__``), bound to the manager, it is called as vLLM calls
  it, and a None it returns (no slots: the call changed nothing) hands the
  request to vLLM's loop, which asks again and stalls or preempts as it
  does; anything else (a wrapper, a mock, another plugin's method) leaves
  the whole loop to vLLM's, which makes every call;
- what vLLM's loop reads of the scheduler only on some paths
  (``ec_connector``, ``current_step``, ``num_lookahead_tokens``,
  ``kv_cache_manager``...) is read only once the loop is sure to run, and
  one the scheduler lacks leaves the loop to vLLM's;
- ``num_tokens`` is ``len(_all_token_ids)``: a ``list``, or the type of
  ``kinds[2]`` (vLLM 0.34.0's ``TokenBuffer``, an ``array('i')``; ``list``
  before it), decided where the patch binds;
- then as vLLM: the request appended to ``scheduled_running_reqs``,
  ``prefill_scheduled |= is_prefill_chunk``, its blocks and token count by
  id, the budgets (``input_budget -= num_new_tokens + draft_slots``),
  ``drafts_needed = drafts_needed or not _drafts_unused(...)`` (0.33.0), and
  with drafts, the ones verified this step (``num_new_tokens +
  num_computed_tokens - num_tokens - num_output_placeholders`` of them) by id
  and ``spec_token_ids = []``.

Counters: ``requests`` (scheduled here), ``skipped`` (passed over as vLLM
does) and ``handed_over`` (calls that left requests to vLLM's loop).
"""

from __future__ import annotations

__all__ = ["schedule_running_requests"]

from types import MethodType
from typing import Any

from fastbatch._reference import allocate_slots as _allocate
from fastbatch._reference._common import Counters

_COUNTERS = Counters(("requests", "skipped", "handed_over"))
stats, reset_stats = _COUNTERS.stats, _COUNTERS.reset_stats

# The compiled piece reads counts as one-digit ints (CPython's compact ints).
_INDEX_LIMIT = 1 << 30
_MISSING = object()


def _is_index(value: Any) -> bool:
    return type(value) is int and -_INDEX_LIMIT < value < _INDEX_LIMIT


def schedule_running_requests(scheduler: Any, req_index: Any, token_budget: Any,
                              input_budget: Any, draft_slots: Any,
                              long_prefill_token_threshold: Any, defer_prefills: Any,
                              prefill_scheduled: Any, drafts_needed: Any,
                              scheduled_running_reqs: Any, req_to_new_blocks: Any,
                              num_scheduled_tokens: Any, scheduled_spec_decode_tokens: Any,
                              kinds: tuple[Any, Any]) -> tuple[Any, Any, Any, Any, Any]:
    """vLLM's running-request loop from ``req_index`` for the requests it can
    take; ``(req_index, token_budget, input_budget, prefill_scheduled,
    drafts_needed)`` as the loop leaves them (``drafts_needed`` None: vLLM
    0.32.0's loop, which has none).  ``kinds``: ``(Request, the
    allocate_slots piece's method, the type of Request._all_token_ids
    besides list, the allocate_slots functions whose None changes
    nothing)``.
    """
    unchanged = (req_index, token_budget, input_budget, prefill_scheduled, drafts_needed)
    if type(kinds) is not tuple or len(kinds) != 4:
        raise TypeError("kinds must be a tuple (Request, allocate_slots, token store type, "
                        "trusted allocate_slots functions)")
    request_type, kernel, token_store, trusted = kinds
    if not isinstance(token_store, type) or type(trusted) is not tuple:
        raise TypeError("kinds must be a tuple (Request, allocate_slots, token store type, "
                        "trusted allocate_slots functions)")
    counts = (req_index, token_budget, input_budget, draft_slots, long_prefill_token_threshold)
    if not all(_is_index(value) for value in counts):
        return unchanged
    index, budget, inputs, slots, threshold = counts
    if (type(defer_prefills) is not bool or type(prefill_scheduled) is not bool
            or not (drafts_needed is None or type(drafts_needed) is bool)
            or type(scheduled_running_reqs) is not list or type(req_to_new_blocks) is not dict
            or type(num_scheduled_tokens) is not dict
            or type(scheduled_spec_decode_tokens) is not dict):
        return unchanged
    running = scheduler.running
    if type(running) is not list:
        return unchanged
    if not (index < len(running) and budget > 0):
        return unchanged  # vLLM's loop reads nothing more of the scheduler
    # What vLLM's loop reads of the scheduler only on some paths: one the
    # scheduler lacks leaves the loop to vLLM's (which may never read it).
    if (getattr(scheduler, "ec_connector", _MISSING) is not None
            or getattr(scheduler, "need_mamba_block_aligned_split", _MISSING) is not False):
        return unchanged
    settings = tuple(getattr(scheduler, name, None) for name in (
        "current_step", "max_model_len", "num_sampled_tokens_per_step",
        "num_prefill_lookahead"))
    if not all(_is_index(value) for value in settings):
        return unchanged
    current_step, max_model_len, sampled_per_step, prefill_lookahead = settings
    lookahead_tokens = getattr(scheduler, "num_lookahead_tokens", None)
    if not _allocate._is_lookahead(lookahead_tokens):
        return unchanged
    manager = getattr(scheduler, "kv_cache_manager", None)
    allocate = getattr(manager, "allocate_slots", None)
    # The piece's own method bound to this manager: the planned call
    # directly; vLLM's own or fastbatch's FASTBATCH_VERIFY check, bound to
    # it: called as vLLM calls it; anything else: vLLM's loop makes every call.
    if not (isinstance(allocate, MethodType) and allocate.__self__ is manager):
        return unchanged
    direct = allocate.__func__ is kernel
    if not direct and not _trusted(allocate.__func__, trusted):
        return unchanged
    # What allocate_slots' plan reads of the manager, once for the loop: a
    # manager it cannot plan for leaves every request to vLLM's loop.
    view = _allocate._manager_view(manager)
    if view is None:
        return unchanged
    any_prefill = prefill_scheduled
    values = _COUNTERS.values
    while index < len(running) and budget > 0:
        request = running[index]
        if inputs <= slots or type(request) is not request_type:
            break
        # Read through its instance dict, as the compiled loop does: one
        # missing reads as None and hands the request to vLLM's loop.
        attrs = getattr(request, "__dict__", None)
        if type(attrs) is not dict:
            break
        placeholders = attrs.get("num_output_placeholders")
        computed = attrs.get("num_computed_tokens")
        if not (_is_index(placeholders) and _is_index(computed)):
            break
        if placeholders > 0:
            prompt_tokens, max_tokens = attrs.get("num_prompt_tokens"), attrs.get("max_tokens")
            if not (_is_index(prompt_tokens) and _is_index(max_tokens)):
                break
            if computed + 2 - placeholders >= prompt_tokens + max_tokens:
                index += 1
                values["skipped"] += 1
                continue
        eligible_step = attrs.get("next_decode_eligible_step")
        if not _is_index(eligible_step):
            break
        if current_step < eligible_step:
            index += 1
            values["skipped"] += 1
            continue
        is_prefill_chunk = attrs.get("is_prefill_chunk")
        if type(is_prefill_chunk) is not bool:
            break
        if defer_prefills and is_prefill_chunk:
            index += 1
            values["skipped"] += 1
            continue
        token_ids, spec_token_ids = attrs.get("_all_token_ids"), attrs.get("spec_token_ids")
        if type(spec_token_ids) is not list:
            break
        # Request.num_tokens: len(_all_token_ids), a list or the release's
        # token store (vLLM 0.34.0: a TokenBuffer, an array('i')).
        if type(token_ids) is not list and type(token_ids) is not token_store:
            break
        num_tokens = len(token_ids)
        num_new = num_tokens + len(spec_token_ids) + placeholders - computed
        if 0 < threshold < num_new:
            num_new = threshold
        num_new = min(num_new, budget, inputs - slots)
        num_new = min(num_new, max_model_len - computed - sampled_per_step)
        # Request.has_encoder_inputs (num_encoder_inputs = len(mm_features) > 0).
        mm_features = attrs.get("mm_features")
        if type(mm_features) is not list or len(mm_features) > 0:
            break
        remaining = num_tokens - computed - num_new
        if 0 < remaining < prefill_lookahead:
            num_new -= prefill_lookahead - remaining
        num_new = max(num_new, 0)
        if num_new == 0:
            index += 1
            values["skipped"] += 1
            continue
        output_token_ids, request_id = attrs.get("_output_token_ids"), attrs.get("request_id")
        if type(request_id) is not str:
            break
        if drafts_needed is not None:
            max_tokens = attrs.get("max_tokens")
            if type(output_token_ids) is not list or not _is_index(max_tokens):
                break
        if direct:
            new_blocks = _allocate._allocate_decode(view, request, num_new, lookahead_tokens,
                                                   True)
            if new_blocks is None:
                break  # vLLM's method allocates (or preempts) in vLLM's loop
        else:
            if _allocate._allocate_decode(view, request, num_new, lookahead_tokens,
                                         False) is None:
                break
            new_blocks = allocate(request, num_new, num_lookahead_tokens=lookahead_tokens)
            if new_blocks is None:
                # What the call returned, not the plan: no slots.  The call
                # changed nothing; vLLM's loop asks again and stalls or preempts.
                break
        # Scheduled: nothing below can fail.
        values["requests"] += 1
        scheduled_running_reqs.append(request)
        any_prefill = any_prefill or is_prefill_chunk
        req_to_new_blocks[request_id] = new_blocks
        num_scheduled_tokens[request_id] = num_new
        budget -= num_new
        inputs -= num_new + slots
        index += 1
        if drafts_needed is False:
            # not Scheduler._drafts_unused(request, computed, num_new)
            unused = (computed + num_new < num_tokens
                      or len(output_token_ids) + 1 + (placeholders > 0) >= max_tokens)
            drafts_needed = not unused
        if spec_token_ids:
            num_spec = num_new + computed - num_tokens - placeholders
            if num_spec > 0:
                if len(spec_token_ids) > num_spec:
                    spec_token_ids = spec_token_ids[:num_spec]
                scheduled_spec_decode_tokens[request_id] = spec_token_ids
            attrs["spec_token_ids"] = []
    if index < len(running) and budget > 0 and inputs > slots:
        values["handed_over"] += 1
    return index, budget, inputs, any_prefill, drafts_needed


def _trusted(function: Any, trusted: tuple[Any, ...]) -> bool:
    """Whether ``function`` is one of ``trusted`` (vLLM's own allocate_slots) or
    fastbatch's FASTBATCH_VERIFY check (``__fastbatch__`` True)."""
    return (any(function is known for known in trusted)
            or getattr(function, "__fastbatch__", False) is True)
