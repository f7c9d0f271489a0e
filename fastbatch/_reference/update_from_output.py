"""Twin of the compiled piece ``update_from_output`` (``fastbatch._kernels.update_from_output``).

``take_decode_outputs`` takes, out of one call of vLLM's
``Scheduler.update_from_output``, the requests that are plain decodes and do
not stop this step, and does to them exactly what vLLM's per-request loop
would; the caller hands the rest to vLLM's own method and merges the outputs
back in scheduling order (``merge_decode_outputs``).

A request is taken only if all of these hold (read off vLLM 0.33.0 and
0.32.0, pinned by the patch's guard); else vLLM's loop takes it:

- it is a RUNNING ``Request`` (exact type) of front-end 0 (if any scheduled
  request is of another front-end, nothing is taken: vLLM orders the
  outputs of several front-ends by first appearance);
- it has no stale output share, no encoder inputs, no pooling, no
  ``logprob_token_ids``, no prefill stats to report, no NaN count and no
  prompt logprobs in this output;
- it has no grammar (``structured_output_request``), or ``accept`` is given
  (vLLM's ``StructuredOutputManager.accept_tokens``) and it has no drafts
  scheduled;
- it has no drafts scheduled, or ``drafts`` is set (the caller sets it when
  the scheduler keeps no statistics and samples one token per step) and
  the request keeps no spec-decode metrics of its own;
- if it asks for sample logprobs (``logprobs`` set: ``num_logprobs`` is not
  None), the step's ``model_runner_output.logprobs`` is None (vLLM then
  gives it none) or a ``LogprobsLists`` (exact type) of numpy arrays (at
  least 1-d) whose ``cu_num_generated_tokens`` is None or a list with an
  int at the request's row;
- exactly one token was sampled for it (an int), or with ``k`` drafts
  scheduled 1 to ``k + 1`` tokens (the drafts accepted, then one sampled;
  with sample logprobs, only one);
- ``check_stop`` after appending each token says "go on": not EOS, not a
  stop token, below ``max_model_len`` and ``max_tokens``, and either below
  ``min_tokens`` or with no repetition detection;
- appending the tokens fills no block to hash (the block hasher is vLLM's
  ``request_block_hasher``, whose block size and lookahead are read from its
  closure);
- the KV-cache call vLLM makes for it, if any, caches nothing: every full
  block of the cacheable tokens is cached already (vLLM 0.32's count of full
  blocks; 0.33's, limited to the hashed tokens, is never larger);
- its ``_all_token_ids`` is a list, or an ``array('i')`` (vLLM 0.34's
  ``TokenBuffer``) whose type keeps ``array``'s ``append``, ``__len__`` and
  ``__delitem__``, and then every token fits a C int (else vLLM's append
  raises: its loop takes it);
- its row is found: by ``req_id_to_index`` (variants 0 to 2), or (variant 3,
  vLLM 0.34, which has no ``req_id_to_index``) as vLLM 0.34 finds it, the last
  position of its id in ``model_runner_output.req_ids``.

What is done to a request taken, as vLLM does: ``num_in_flight_tokens``
less the scheduled count; with drafts, the ``r`` rejected (drafts less the
tokens accepted) taken off ``num_computed_tokens`` and
``num_output_placeholders`` where each is positive; the tokens appended to
``_output_token_ids`` and ``_all_token_ids`` (the same int objects; to an
array one at a time with ``array.append``, as vLLM's
``append_output_token_ids`` does); an
output placeholder resolved per token (``variant``: 0, vLLM 0.33, and 3,
vLLM 0.34, when there are any, and there must be enough; 1, vLLM 0.32's
``AsyncScheduler``, always, so there must be enough; 2, vLLM 0.32's sync
``Scheduler``, never); under variant 3 the blocks are also cached under
vLLM 0.34's Mamba rule (``has_mamba_layers``, sync scheduling, prefix
caching; a scheduler on which it cannot be read leaves such requests to
vLLM's loop);
its events taken; an ``EngineCoreOutput`` with the
sampled list itself as ``new_token_ids`` and, for a request with sample
logprobs, ``new_logprobs`` as vLLM's loop makes it:
``logprobs.slice_request(row, 1)`` (views of the step's arrays).  For a
request with a grammar, ``accept(request, tokens)`` right after its tokens
are appended and its counts set (vLLM's loop calls ``accept_tokens`` after
``_update_request_with_output``); if the answer is false (vLLM's loop then
stops the request with an error), the request is put back as it was, its id
goes to ``refused`` and vLLM's loop takes it: the caller must have it see
the same answer without asking the grammar again.  An exception from
``accept`` propagates; the requests before it in pass 2 are already updated.

``kinds`` is ``(Request, RequestStatus.RUNNING, KVCacheManager,
(coordinator types...), FullAttentionManager, request_block_hasher's code,
EngineCoreOutput, template, LogprobsLists or None, numpy.ndarray)``
(``None``: requests with sample logprobs go to vLLM's loop unless the step
has none); ``template`` is ``(positional arguments, index of request_id, of
new_token_ids, of stop_reason, of events, of trace_headers, of
num_nans_in_logits, of new_logprobs)``.
"""

from __future__ import annotations

__all__ = ["merge_decode_outputs", "take_decode_outputs"]

from array import array
from typing import Any

from fastbatch._reference._common import Counters

_COUNTERS = Counters(("fast_outputs", "stock_outputs"))
stats, reset_stats = _COUNTERS.stats, _COUNTERS.reset_stats

PLACEHOLDERS_IN_BASE, ASYNC_OVERRIDE, NO_PLACEHOLDERS, ROWS_FROM_REQ_IDS = 0, 1, 2, 3
_INT_MIN, _INT_MAX = -(2**31), 2**31 - 1  # a C int: array('i')
# The step's sample logprobs: None (a request with logprobs gets none), a
# LogprobsLists to slice, or anything else (such requests go to vLLM's loop).
LOGPROBS_NONE, LOGPROBS_SLICE, LOGPROBS_LEAVE = 0, 1, 2
_SSIZE_MIN, _SSIZE_MAX = -(2**63), 2**63 - 1


def _is_int(*values: Any) -> bool:
    return all(type(value) is int for value in values)


class _Cache:
    """The KV-cache manager of one step, read once: is ``cache_blocks`` a no-op?"""

    def __init__(self, manager: Any, kinds: tuple[Any, ...]) -> None:
        self.plain = False
        manager_type, coordinator_types, single_type = kinds[2], kinds[3], kinds[4]
        if type(manager) is not manager_type:
            return
        if not manager.enable_caching:
            self.caching, self.plain = False, True
            return
        coordinator = manager.coordinator
        if type(coordinator) not in coordinator_types:
            return
        singles = coordinator.single_type_managers
        if type(singles) is not tuple or len(singles) != 1 or type(singles[0]) is not single_type:
            return
        single = singles[0]
        self.caching = bool(single.enable_caching) and bool(single.kv_cache_spec.prefix_cacheable)
        if not self.caching:
            self.plain = True
            return
        self.num_cached = single.num_cached_block
        self.block_size = single.block_size
        self.reprefillable = coordinator.num_reprefillable_tokens
        self.plain = (isinstance(self.num_cached, dict) and _is_int(self.block_size,
                                                                    self.reprefillable)
                      and self.block_size > 0)

    def is_noop(self, request_id: Any, num_tokens: int) -> bool:
        if not self.caching:
            return True
        cached = self.num_cached.get(request_id, 0)
        if not _is_int(cached):
            return False
        return cached >= max(0, num_tokens - self.reprefillable) // self.block_size


def _hasher_sizes(hasher: Any, code: Any) -> tuple[int, int] | None:
    if getattr(hasher, "__code__", None) is not code:
        return None
    cells = dict(zip(code.co_freevars, [cell.cell_contents for cell in hasher.__closure__],
                     strict=True))
    block_size, lookahead = cells.get("hash_block_size"), cells.get("num_hash_lookahead_tokens", 0)
    if not _is_int(block_size, lookahead) or block_size <= 0:
        return None
    return block_size, lookahead


def _token_store(tokens: Any) -> bool:
    """``tokens`` is an ``array('i')`` appended and measured as ``array`` does."""
    store_type = type(tokens)
    return (issubclass(store_type, array) and store_type.append is array.append
            and store_type.__len__ is array.__len__
            and store_type.__delitem__ is array.__delitem__ and tokens.typecode == "i")


def _mamba_rule(scheduler: Any) -> int:
    """vLLM 0.34's Mamba condition for caching blocks: 1, 0, or -1 if it
    cannot be read."""
    try:
        return int(bool(scheduler.has_mamba_layers
                        and not scheduler.scheduler_config.async_scheduling
                        and scheduler.cache_config.enable_prefix_caching))
    except Exception:
        return -1


def _rows(req_ids: list[Any]) -> dict[Any, int] | None:
    """Each id's row as vLLM 0.34 finds it (``req_ids`` has no
    ``req_id_to_index`` beside it), or None where vLLM's dict raises (the step
    goes to vLLM)."""
    try:
        return {req_id: i for i, req_id in enumerate(req_ids)}
    except Exception:
        return None


def _logprobs_mode(logprobs: Any, kinds: tuple[Any, ...]) -> int:
    if logprobs is None:
        return LOGPROBS_NONE
    logprobs_type, array_type = kinds[8], kinds[9]
    if logprobs_type is None or type(logprobs) is not logprobs_type or len(logprobs) != 4:
        return LOGPROBS_LEAVE
    *arrays, cu_rows = logprobs
    if cu_rows is not None and type(cu_rows) is not list:
        return LOGPROBS_LEAVE
    if not all(type(array) is array_type and array.ndim >= 1 for array in arrays):
        return LOGPROBS_LEAVE
    return LOGPROBS_SLICE


def _classify(request: Any, tokens: Any, drafts: Any, num_scheduled: int,
              kinds: tuple[Any, ...], variant: int, max_model_len: int,
              num_spec_tokens: int, mamba: int, cache: _Cache, row: int, logprobs: Any,
              logprobs_mode: int) -> tuple[int, int, int, bool] | None:
    """``(in-flight count after, placeholders after or -1, computed tokens
    after or -1, whether it gets sample logprobs)`` if ``request`` (with
    ``drafts``, the draft ids scheduled, or None) is taken, None if vLLM's
    loop must take it."""
    if type(request) is not kinds[0] or request.status is not kinds[1]:
        return None
    if type(tokens) is not list or not tokens or not all(type(t) is int for t in tokens):
        return None
    rejected = 0
    if drafts is None:
        if len(tokens) != 1:
            return None
    else:
        # vLLM's loop: the drafts not accepted (of the tokens, all but the one
        # sampled) are rejected; per-request spec metrics go to vLLM.
        if (type(drafts) is not list or len(tokens) - 1 > len(drafts)
                or request.spec_decode_metrics is not None):
            return None
        rejected = len(drafts) - (len(tokens) - 1)
    stale, in_flight = request.num_stale_output_tokens, request.num_in_flight_tokens
    if not _is_int(stale, in_flight) or stale != 0:
        return None
    mm_features = request.mm_features
    if type(mm_features) is not list or mm_features:
        return None
    if request.pooling_params is not None or request.prefill_stats is not None:
        return None
    params = request.sampling_params
    if params is None or params.logprob_token_ids:
        return None
    # num_logprobs is logprobs now: vLLM slices the step's logprobs if any.
    with_logprobs = params.logprobs is not None and logprobs_mode == LOGPROBS_SLICE
    if params.logprobs is not None and (logprobs_mode == LOGPROBS_LEAVE or len(tokens) != 1):
        return None
    if with_logprobs and logprobs[3] is not None:
        cu_rows = logprobs[3]
        if not (row < len(cu_rows) and _is_int(cu_rows[row])
                and _SSIZE_MIN <= cu_rows[row] < _SSIZE_MAX):
            return None
    output_ids, all_ids = request._output_token_ids, request._all_token_ids
    if type(output_ids) is not list:
        return None
    if type(all_ids) is not list and not (
            _token_store(all_ids) and all(_INT_MIN <= t <= _INT_MAX for t in tokens)):
        return None
    # check_stop after each token: "go on" (the counts only grow: the last's).
    num_tokens, num_output = len(all_ids) + len(tokens), len(output_ids) + len(tokens)
    eos = params.eos_token_id
    if eos is not None and (type(eos) is not int or eos in tokens):
        return None
    stop_ids = params.stop_token_ids
    if stop_ids and (type(stop_ids) is not list or any(t in stop_ids for t in tokens)):
        return None
    max_tokens, min_tokens = request.max_tokens, params.min_tokens
    if not _is_int(max_tokens) or num_tokens >= max_model_len or num_output >= max_tokens:
        return None
    if not _is_int(min_tokens):
        return None
    if num_output >= min_tokens and params.repetition_detection is not None:
        return None
    hasher = request._block_hasher
    if hasher is not None:
        hashes = request.block_hashes
        sizes = _hasher_sizes(hasher, kinds[5])
        if type(hashes) is not list or sizes is None:
            return None
        block_size, lookahead = sizes
        if (len(hashes) + 1) * block_size <= num_tokens - lookahead:
            return None
    placeholders, computed = request.num_output_placeholders, request.num_computed_tokens
    if not _is_int(placeholders, computed):
        return None
    in_flight_after, placeholders_after, computed_after = in_flight - num_scheduled, -1, -1
    if rejected:
        if computed > 0:
            computed = computed_after = computed - rejected
        if placeholders > 0:
            placeholders = placeholders_after = placeholders - rejected
    cache_upto, num_new = -1, len(tokens)
    if variant in (PLACEHOLDERS_IN_BASE, ROWS_FROM_REQ_IDS):
        if placeholders > 0:
            if placeholders < num_new:
                return None  # vLLM's assert fails
            placeholders_after = placeholders - num_new
        if placeholders > 0 or num_spec_tokens > 0:
            cache_upto = computed - in_flight_after
        elif variant == ROWS_FROM_REQ_IDS:
            if mamba < 0:
                return None  # vLLM's loop reads the condition here (and raises)
            if mamba:
                cache_upto = computed - in_flight_after
    elif variant == ASYNC_OVERRIDE:
        if placeholders < num_new:
            return None  # vLLM's assert fails
        placeholders_after = placeholders - num_new
        cache_upto = computed - placeholders_after
    if cache_upto >= 0 and not cache.is_noop(request.request_id, cache_upto):
        return None
    return in_flight_after, placeholders_after, computed_after, with_logprobs


def take_decode_outputs(scheduler: Any, scheduler_output: Any, model_runner_output: Any,
                        kinds: tuple[Any, ...], variant: int, drafts: bool = False,
                        accept: Any = None,
                        refused: list[str] | None = None) -> tuple[list, dict] | None:
    """Take the plain decodes of one ``update_from_output`` call; with
    ``drafts``, also those with scheduled drafts (spec decoding); with
    ``accept`` (vLLM's ``StructuredOutputManager.accept_tokens``), also those
    with a grammar and no drafts (the id of each whose tokens it refuses goes
    to ``refused``).

    Returns ``None`` (nothing taken, nothing changed) or ``(slots, rest)``:
    ``slots`` has, in scheduling order, the ``EngineCoreOutput`` of each
    request taken and the request id of each request left; ``rest`` maps the
    ids left to their scheduled token counts, for vLLM's own loop.

    ``variant`` 3 (vLLM 0.34) finds each request's row by its position in
    ``model_runner_output.req_ids``; the others by ``req_id_to_index``.
    """
    if accept is not None and (not callable(accept) or type(refused) is not list):
        raise TypeError("accept must be callable and come with a refused list")
    if not isinstance(kinds, tuple):
        raise TypeError(f"kinds must be a tuple, got {type(kinds).__name__}")
    if len(kinds) != 10:
        raise ValueError(f"kinds must have 10 items, got {len(kinds)}")
    output_type, template, logprobs_type = kinds[6], kinds[7], kinds[8]
    if type(template) is not tuple or len(template) != 8:
        raise ValueError("kinds[7] must be the 8-item EngineCoreOutput template")
    if logprobs_type is not None and not (isinstance(logprobs_type, type)
                                          and issubclass(logprobs_type, tuple)):
        raise ValueError("kinds[8] must be LogprobsLists (a tuple type) or None")
    if variant not in (PLACEHOLDERS_IN_BASE, ASYNC_OVERRIDE, NO_PLACEHOLDERS,
                       ROWS_FROM_REQ_IDS):
        raise ValueError(f"variant must be 0, 1, 2 or 3, got {variant}")
    requests = scheduler.requests
    scheduled = scheduler_output.num_scheduled_tokens
    spec_tokens = scheduler_output.scheduled_spec_decode_tokens
    index_of = {} if variant == ROWS_FROM_REQ_IDS else model_runner_output.req_id_to_index
    if variant == ROWS_FROM_REQ_IDS and not isinstance(model_runner_output.req_ids, list):
        raise TypeError("req_ids must be a list, got "
                        f"{type(model_runner_output.req_ids).__name__}")
    sampled = model_runner_output.sampled_token_ids
    nans = model_runner_output.num_nans_in_logits
    prompt_logprobs = model_runner_output.prompt_logprobs_dict
    prompt_token_logprobs = model_runner_output.prompt_token_id_logprobs_dict
    for name, value in (("scheduler.requests", requests),
                        ("num_scheduled_tokens", scheduled),
                        ("scheduled_spec_decode_tokens", spec_tokens),
                        ("req_id_to_index", index_of),
                        ("prompt_logprobs_dict", prompt_logprobs),
                        ("prompt_token_id_logprobs_dict", prompt_token_logprobs)):
        if not isinstance(value, dict):
            raise TypeError(f"{name} must be a dict, got {type(value).__name__}")
    if not isinstance(sampled, list):
        raise TypeError(f"sampled_token_ids must be a list, got {type(sampled).__name__}")
    if nans is not None and not isinstance(nans, dict):
        raise TypeError(f"num_nans_in_logits must be a dict or None, got {type(nans).__name__}")
    # (read as vLLM's loop reads them for a request taken; missing: vLLM's loop)
    max_model_len = getattr(scheduler, "max_model_len", None)
    num_spec_tokens = getattr(scheduler, "num_spec_tokens", None)
    if not _is_int(max_model_len, num_spec_tokens):
        return None
    mamba = _mamba_rule(scheduler) if variant == ROWS_FROM_REQ_IDS else 0
    cache = _Cache(getattr(scheduler, "kv_cache_manager", None), kinds)
    if not cache.plain:
        return None
    if variant == ROWS_FROM_REQ_IDS:
        index_of = _rows(model_runner_output.req_ids)
        if index_of is None:
            return None
    logprobs = model_runner_output.logprobs
    logprobs_mode = _logprobs_mode(logprobs, kinds)
    slots: list[Any] = []
    rest: dict[Any, Any] = {}
    taken: list[tuple[str, Any, int, tuple[int, int, int, bool], bool]] = []
    for req_id, num_scheduled in scheduled.items():
        if type(req_id) is not str:
            return None  # the slots tell ids (str) from outputs by type
        request = requests.get(req_id)
        if request is not None and request.client_index != 0:
            return None
        request_drafts = spec_tokens.get(req_id) or None
        has_grammar = (type(request) is kinds[0]
                       and request.structured_output_request is not None)
        if has_grammar and (accept is None or request_drafts is not None):
            slots.append(req_id)  # a grammar to advance, not here: vLLM's loop
            rest[req_id] = num_scheduled
            continue
        if (request is None or not _is_int(num_scheduled) or num_scheduled <= 0
                or (request_drafts is not None and not drafts)
                or (nans is not None and req_id in nans)
                or req_id in prompt_logprobs or req_id in prompt_token_logprobs):
            slots.append(req_id)
            rest[req_id] = num_scheduled
            continue
        row = index_of.get(req_id)
        tokens = sampled[row] if type(row) is int and 0 <= row < len(sampled) else None
        effects = None if tokens is None else _classify(
            request, tokens, request_drafts, num_scheduled, kinds, variant, max_model_len,
            num_spec_tokens, mamba, cache, row, logprobs, logprobs_mode)
        if effects is None:
            slots.append(req_id)
            rest[req_id] = num_scheduled
        else:
            slots.append(tokens)
            taken.append((req_id, request, row, effects, has_grammar))
    if not taken:
        return None
    args = list(template[0])
    at_id, at_tokens, at_stop, at_events, at_trace, at_nans, at_logprobs = template[1:]
    pending = iter(taken)
    num_refused = 0
    for index, tokens in enumerate(slots):
        if type(tokens) is not list:
            continue
        req_id, request, row, effects, has_grammar = next(pending)
        in_flight_after, placeholders_after, computed_after, with_logprobs = effects
        if has_grammar:
            before = (request.num_in_flight_tokens, request.num_computed_tokens,
                      request.num_output_placeholders)
        request.num_in_flight_tokens = in_flight_after
        for token in tokens:  # as append_output_token_ids, a token at a time
            request._output_token_ids.append(token)
            request._all_token_ids.append(token)
        if computed_after >= 0:
            request.num_computed_tokens = computed_after
        if placeholders_after >= 0:
            request.num_output_placeholders = placeholders_after
        if has_grammar and not accept(request, tokens):
            # vLLM's loop stops it with an error: the request as it was, to vLLM.
            (request.num_in_flight_tokens, request.num_computed_tokens,
             request.num_output_placeholders) = before
            del request._output_token_ids[-len(tokens):]
            del request._all_token_ids[-len(tokens):]
            slots[index] = req_id
            refused.append(req_id)
            num_refused += 1
            continue
        events = request.events
        if events:
            request.events = []
        else:
            events = None
        args[at_id] = request.request_id
        args[at_tokens] = tokens
        args[at_stop] = request.stop_reason
        args[at_events] = events
        args[at_trace] = request.trace_headers
        args[at_nans] = request.num_nans_in_logits
        # As vLLM's loop: the request's slice of the step's LogprobsLists.
        args[at_logprobs] = logprobs.slice_request(row, len(tokens)) if with_logprobs else None
        slots[index] = output_type(*args)
    if num_refused:
        # vLLM's loop takes the requests left in scheduling order.
        rest = {req_id: scheduled[req_id] for req_id in slots if type(req_id) is str}
    _COUNTERS.values["fast_outputs"] += len(taken) - num_refused
    _COUNTERS.values["stock_outputs"] += len(rest)
    return slots, rest


def merge_decode_outputs(slots: list[Any], stock_outputs: list[Any]) -> list[Any]:
    """The step's outputs in scheduling order: each slot's own output, or for a
    request id, vLLM's output for it if its loop made one; then any outputs of
    vLLM's left over (those its loop adds after the requests, in order)."""
    if not isinstance(slots, list) or not isinstance(stock_outputs, list):
        raise TypeError("slots and stock_outputs must be lists")
    merged, j = [], 0
    for slot in slots:
        if type(slot) is str:
            if j < len(stock_outputs) and stock_outputs[j].request_id == slot:
                merged.append(stock_outputs[j])
                j += 1
        else:
            merged.append(slot)
    merged.extend(stock_outputs[j:])
    return merged
