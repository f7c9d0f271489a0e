"""Pure-Python twin of the compiled piece ``after_schedule``
(``fastbatch._kernels.after_schedule``).

``update_after_schedule`` does the per-request work of vLLM's
``Scheduler._update_after_schedule`` and, given the step's spec-token
placeholder list, that of ``AsyncScheduler._update_after_schedule`` too, in
ONE pass: for each scheduled request, the base loop's effects, then the async
loop's, which read what the base loop just set (``is_prefill_chunk``).  vLLM
runs the two loops one after the other; each request is a distinct object
(checked: ``request.request_id`` is its key), so doing both per request
gives the same end state.  What the methods do besides their loops (clear
``finished_req_ids`` and ``reset_preempted_req_ids``, keep the placeholder
list on the scheduler) stays in the patch, as vLLM wrote it.

It first checks the whole batch and changes nothing unless every scheduled
request is a plain ``Request`` of the scheduler's (exact type, its own id as
key, counters that are ints, a token store that is a list or an
``array.array`` whose type keeps array's ``__len__``, as vLLM 0.34.0's
``TokenBuffer``) and the flags it
reads are what vLLM keeps there (bools, ints, a set, dicts).  Otherwise it
returns False and the caller runs vLLM's method, which then behaves exactly
as stock (a missing request raises vLLM's KeyError there).  A request's
attributes are read and written through its instance dict, as the compiled
call does (each is a plain instance attribute of vLLM's ``Request``: the
patch's activation check confirms it), so a request missing one is left to
vLLM's method too.

Read off vLLM 0.33.0's and 0.34.0's code (pinned by the patch's guard):

- ``request.num_computed_tokens += n`` and ``num_in_flight_tokens += n``;
  ``last_sched_seq = scheduler.sched_step_seq`` (the same object) when
  ``defer_block_free``;
- ``is_prefill_chunk = num_computed_tokens < num_tokens +
  num_output_placeholders`` (``num_tokens`` is ``len(_all_token_ids)``);
- ``has_structured_output_requests |= use_structured_output and not
  is_prefill_chunk`` (``use_structured_output`` is
  ``structured_output_request is not None``); a request that is no longer a
  prefill chunk leaves ``_inflight_prefills``;
- async, for a request that is not a prefill chunk:
  ``pending_structured_output_tokens |= use_structured_output and
  num_output_placeholders > 0`` (before the increment), then
  ``num_output_placeholders += num_sampled_tokens_per_step + len(spec ids)``,
  ``spec_token_ids = placeholders`` (one list object for all), and
  ``next_decode_eligible_step = current_step + decode_stagger``: on vLLM
  0.34.0 always (``always_eligible``), up to 0.33.0 only with
  ``use_v2_model_runner`` (which 0.34.0 no longer has).
"""

from __future__ import annotations

__all__ = ["update_after_schedule"]

from array import array
from typing import Any

from fastbatch._reference._common import Counters

_COUNTERS = Counters(("requests", "stock_calls"))
stats, reset_stats = _COUNTERS.stats, _COUNTERS.reset_stats


def _plain_token_array(token_type: type) -> bool:
    """Whether ``token_type`` is ``array.array`` or a subclass that keeps its
    ``__len__`` (what ``len()`` of a token store of that type gives is then
    the array's length)."""
    return issubclass(token_type, array) and token_type.__len__ is array.__len__


def _plain_batch(scheduler: Any, scheduler_output: Any, is_async: bool, always_eligible: bool,
                 request_type: type) -> list[Any] | None:
    """The scheduled requests in order, or None if anything is not as vLLM keeps it."""
    num_scheduled = scheduler_output.num_scheduled_tokens
    requests = scheduler.requests
    if (type(num_scheduled) is not dict or type(requests) is not dict
            or type(scheduler._inflight_prefills) is not set
            or type(scheduler_output.has_structured_output_requests) is not bool
            or type(scheduler.defer_block_free) is not bool):
        return None
    spec_tokens: dict[Any, Any] = {}
    if is_async:
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        if (type(spec_tokens) is not dict
                or type(scheduler_output.pending_structured_output_tokens) is not bool
                or type(scheduler.num_sampled_tokens_per_step) is not int):
            return None
        use_v2 = True if always_eligible else scheduler.use_v2_model_runner
        if (type(use_v2) is not bool
                or (use_v2 and (type(scheduler.current_step) is not int
                                or type(scheduler.decode_stagger) is not int))):
            return None
    batch = []
    for req_id, num_tokens in num_scheduled.items():
        request = requests.get(req_id) if type(req_id) is str else None
        if type(request) is not request_type or type(num_tokens) is not int:
            return None
        attrs = getattr(request, "__dict__", None)
        if (type(attrs) is not dict
                or type(attrs.get("num_computed_tokens")) is not int
                or type(attrs.get("num_in_flight_tokens")) is not int
                or type(attrs.get("num_output_placeholders")) is not int
                or "structured_output_request" not in attrs
                or type(attrs.get("request_id")) is not str or attrs["request_id"] != req_id):
            return None
        token_type = type(attrs.get("_all_token_ids"))
        if token_type is not list and not _plain_token_array(token_type):
            return None
        spec = spec_tokens.get(req_id) if is_async else None
        if spec is not None and type(spec) is not list:
            return None
        batch.append(attrs)
    return batch


def update_after_schedule(scheduler: Any, scheduler_output: Any,
                          spec_token_placeholders: list[int] | None,
                          request_type: type, *, always_eligible: bool) -> bool:
    """vLLM's per-request loop of ``Scheduler._update_after_schedule`` and,
    when ``spec_token_placeholders`` is a list, that of
    ``AsyncScheduler._update_after_schedule`` in the same pass.  True when
    done; False, with nothing changed, when the caller must run vLLM's method.

    ``request_type`` is vLLM's ``Request``.  ``always_eligible`` (async only):
    every decoding request gets ``next_decode_eligible_step`` (vLLM 0.34.0);
    False: only when ``scheduler.use_v2_model_runner`` (vLLM 0.31.0 to 0.33.0).
    """
    if spec_token_placeholders is not None and type(spec_token_placeholders) is not list:
        raise TypeError("spec_token_placeholders must be a list or None, "
                        f"got {type(spec_token_placeholders).__name__}")
    if not isinstance(request_type, type):
        raise TypeError(f"request_type must be a class, got {type(request_type).__name__}")
    if type(always_eligible) is not bool:
        raise TypeError(f"always_eligible must be a bool, got {type(always_eligible).__name__}")
    is_async = spec_token_placeholders is not None
    batch = _plain_batch(scheduler, scheduler_output, is_async, always_eligible, request_type)
    if batch is None:
        _COUNTERS.values["stock_calls"] += 1
        return False
    if not batch:
        return True
    num_scheduled = scheduler_output.num_scheduled_tokens
    defer = scheduler.defer_block_free
    step_seq = scheduler.sched_step_seq if defer else None
    inflight_prefills = scheduler._inflight_prefills
    has_structured = scheduler_output.has_structured_output_requests
    if is_async:
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        pending_structured = scheduler_output.pending_structured_output_tokens
        per_step = scheduler.num_sampled_tokens_per_step
        use_v2 = always_eligible or scheduler.use_v2_model_runner
        if use_v2:
            current_step, stagger = scheduler.current_step, scheduler.decode_stagger
    for attrs, (req_id, num_tokens) in zip(batch, num_scheduled.items(), strict=True):
        attrs["num_computed_tokens"] += num_tokens
        attrs["num_in_flight_tokens"] += num_tokens
        if defer:
            attrs["last_sched_seq"] = step_seq
        prefill_chunk = attrs["num_computed_tokens"] < (
            len(attrs["_all_token_ids"]) + attrs["num_output_placeholders"])
        attrs["is_prefill_chunk"] = prefill_chunk
        structured = attrs["structured_output_request"] is not None
        has_structured = has_structured or (structured and not prefill_chunk)
        if prefill_chunk:
            continue
        if inflight_prefills:
            inflight_prefills.discard(scheduler.requests[req_id])
        if not is_async:
            continue
        pending_structured = pending_structured or (
            structured and attrs["num_output_placeholders"] > 0)
        attrs["num_output_placeholders"] += per_step + len(
            spec_tokens.get(req_id, ()))
        attrs["spec_token_ids"] = spec_token_placeholders
        if use_v2:
            attrs["next_decode_eligible_step"] = current_step + stagger
    scheduler_output.has_structured_output_requests = has_structured
    if is_async:
        scheduler_output.pending_structured_output_tokens = pending_structured
    _COUNTERS.values["requests"] += len(batch)
    return True
