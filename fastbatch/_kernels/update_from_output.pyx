# Compiler directives are set in setup.py (one place, with a debug switch).
"""Compiled piece ``update_from_output``: the plain decodes of vLLM's
``Scheduler.update_from_output`` (with their drafts, under spec decoding),
taken in one call.

The same decisions and effects as ``fastbatch._reference.update_from_output``
(see its module note for why each condition): a first pass only reads and
classifies every scheduled request (prefetching the requests ahead of
it, ``ScheduledPrefetch``: in the engine their memory is cold after the
forward pass); a second pass applies, to the requests
taken, exactly what vLLM's loop would (in-flight count, the rejected drafts
taken back from the computed and placeholder counts, the tokens appended
to both token lists, the placeholders resolved) and builds their
``EngineCoreOutput`` (with its sample logprobs: the row of the step's
``LogprobsLists``, sliced as ``LogprobsLists.slice_request`` does), and
for a request with a grammar, the tokens handed to vLLM's ``accept_tokens``
as its loop does (a request whose tokens the grammar refuses is put back as
it was and left to vLLM's loop).  Nothing is changed unless the whole step
has been read and found consistent.

A request's ``_all_token_ids`` is a list (vLLM 0.21-0.33) or an ``array('i')``
(vLLM 0.34's ``TokenBuffer``) whose type keeps ``array``'s ``append``,
``__len__`` and ``__delitem__``: its tokens are appended one at a time with
``array.append``, as vLLM's ``Request.append_output_token_ids`` does, and
only tokens that fit a C int (else vLLM's append raises: its loop takes it).
"""

__all__ = ["merge_decode_outputs", "take_decode_outputs"]

cimport cython
from cpython.list cimport PyList_Append, PyList_GET_ITEM, PyList_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.object cimport PyObject
from cpython.slice cimport PySlice_New
from libc.limits cimport INT_MAX, INT_MIN
from libc.stdint cimport uint64_t

from array import array as _array

from fastbatch._kernels._common cimport (
    Py_None, Py_SIZE, PyDict_GetItemWithError, PyList_CheckExact, PyLong_CheckExact,
    ScheduledPrefetch, long_as_compact)
from fastbatch._kernels._common cimport (
    PY_SSIZE_T_MAX, PyDict_Next, PyObject_GenericGetDict, PySequence_Contains)

cdef extern from *:
    """
    /* tuple.__new__(type, (a, b, c, d)): what a NamedTuple's __new__ does. */
    static PyObject* __pyx_fb_named_tuple4(PyObject* type, PyObject* a, PyObject* b,
                                           PyObject* c, PyObject* d) {
        PyObject* items = PyTuple_Pack(4, a, b, c, d);
        PyObject* args;
        PyObject* result;
        if (items == NULL) return NULL;
        args = PyTuple_Pack(1, items);
        Py_DECREF(items);
        if (args == NULL) return NULL;
        result = PyTuple_Type.tp_new((PyTypeObject*)type, args, NULL);
        Py_DECREF(args);
        return result;
    }
    """
    object _named_tuple4 "__pyx_fb_named_tuple4"(object type, object a, object b, object c,
                                                 object d)

cdef uint64_t _taken = 0
cdef uint64_t _left = 0

# Variants of the per-request effects (``fastbatch.patches.update_from_output``
# picks one from the fingerprints of the vLLM in use).
cdef enum:
    # vLLM 0.33: the base ``_update_request_with_output`` resolves a placeholder;
    # ``update_from_output`` caches blocks when the request had placeholders
    # (or spec decoding is configured).
    PLACEHOLDERS_IN_BASE = 0
    # vLLM 0.32 ``AsyncScheduler``: its override resolves the placeholder and
    # caches up to ``num_computed_tokens - num_output_placeholders``.
    ASYNC_OVERRIDE = 1
    # vLLM 0.32 ``Scheduler`` (sync): no placeholder, no caching here.
    NO_PLACEHOLDERS = 2
    # vLLM 0.34: as PLACEHOLDERS_IN_BASE, and ``update_from_output`` also
    # caches blocks under its Mamba rule (``has_mamba_layers``, sync
    # scheduling, prefix caching); the rows are the requests' positions in
    # ``model_runner_output.req_ids`` (no ``req_id_to_index``: vLLM maps each
    # id to its last position there).
    ROWS_FROM_REQ_IDS = 3

# The step's sample logprobs (``model_runner_output.logprobs``).
cdef enum:
    LOGPROBS_NONE = 0    # None: a request with logprobs gets ``new_logprobs=None``
    LOGPROBS_SLICE = 1   # a LogprobsLists of numpy arrays: its request's row, sliced
    LOGPROBS_LEAVE = 2   # anything else: requests with logprobs go to vLLM's loop


def stats():
    """This piece's counters since import or the last ``reset_stats()``."""
    return {"fast_outputs": _taken, "stock_outputs": _left}


def reset_stats():
    """Set every counter of ``stats()`` back to zero."""
    global _taken, _left
    _taken = _left = 0


cdef struct Taken:
    Py_ssize_t in_flight       # num_in_flight_tokens after the step
    Py_ssize_t placeholders    # num_output_placeholders after, or -1: unchanged
    Py_ssize_t computed        # num_computed_tokens after, or -1: unchanged
    Py_ssize_t logprobs_start  # the first row of its sample logprobs (if it has some)
    bint has_logprobs          # it gets a slice of the step's LogprobsLists
    bint has_grammar           # its tokens go to the grammar (``accept``)


cdef inline bint _int_value(object value, Py_ssize_t* out) except -1:
    """``value`` as a C integer if it is exactly an int that fits, else False."""
    if type(value) is not int:
        return False
    try:
        out[0] = value
    except OverflowError:
        return False
    return True


cdef inline PyObject* _peek(dict attrs, str name) except? NULL:
    """``attrs[name]`` borrowed (no reference-count write on a cold object),
    or NULL if it is missing."""
    return PyDict_GetItemWithError(<PyObject*>attrs, <PyObject*>name)


cdef inline bint _int_at(dict attrs, str name, Py_ssize_t* out) except -1:
    """``_int_value(attrs.get(name), out)``, reading a one-digit int inline."""
    cdef PyObject* value = _peek(attrs, name)
    cdef long long number
    if value == NULL or not PyLong_CheckExact(value):
        return False
    if long_as_compact(value, &number):
        out[0] = <Py_ssize_t>number
        return True
    return _int_value(<object>value, out)


@cython.final
cdef class _Cache:
    """The KV-cache manager of one step, read once: is ``cache_blocks`` a no-op?"""
    cdef bint caching      # any group caches at all
    cdef dict num_cached   # the single full-attention group's num_cached_block
    cdef Py_ssize_t block_size, reprefillable

    cdef bint read(self, object manager, tuple kinds) except -1:
        manager_type, coordinator_types, single_type = kinds[2], kinds[3], kinds[4]
        if type(manager) is not manager_type:
            return False
        if not manager.enable_caching:
            self.caching = False
            return True
        coordinator = manager.coordinator
        if type(coordinator) not in coordinator_types:
            return False
        singles = coordinator.single_type_managers
        if type(singles) is not tuple or len(<tuple>singles) != 1:
            return False
        single = (<tuple>singles)[0]
        if type(single) is not single_type:
            return False
        self.caching = bool(single.enable_caching) and bool(single.kv_cache_spec.prefix_cacheable)
        if not self.caching:
            return True
        num_cached = single.num_cached_block
        if not isinstance(num_cached, dict):
            return False
        self.num_cached = <dict>num_cached
        if not _int_value(single.block_size, &self.block_size) or self.block_size <= 0:
            return False
        if not _int_value(coordinator.num_reprefillable_tokens, &self.reprefillable):
            return False
        return True

    cdef bint is_noop(self, object request_id, Py_ssize_t num_tokens) except -1:
        """``manager.cache_blocks(request, num_tokens)`` changes nothing: every
        full block of the cacheable tokens is cached already (vLLM 0.32's count,
        which 0.33's, limited to hashed tokens, never exceeds)."""
        cdef Py_ssize_t cached, cacheable
        if not self.caching:
            return True
        if not _int_value(self.num_cached.get(request_id, 0), &cached):
            return False
        cacheable = num_tokens - self.reprefillable
        if cacheable < 0:
            cacheable = 0
        return cached >= cacheable // self.block_size


@cython.final
cdef class _Hasher:
    """The block hasher last seen (one is shared by every request of an
    engine): its hash block size and lookahead, read once from its closure
    (vLLM 0.32's hasher has no lookahead: 0)."""
    cdef object hasher
    cdef Py_ssize_t block_size, lookahead

    cdef bint read(self, object hasher, object code) except -1:
        if hasher is self.hasher:
            return True
        if getattr(hasher, "__code__", None) is not code:
            return False
        cells = dict(zip(code.co_freevars, [cell.cell_contents for cell in hasher.__closure__]))
        if not (_int_value(cells.get("hash_block_size"), &self.block_size)
                and _int_value(cells.get("num_hash_lookahead_tokens", 0), &self.lookahead)):
            return False
        if self.block_size <= 0:
            return False
        self.hasher = hasher
        return True


cdef _Hasher _hasher = _Hasher()

_ARRAY_APPEND = _array.append


@cython.final
cdef class _TokenStore:
    """The array type last accepted as ``_all_token_ids`` (vLLM 0.34's
    ``TokenBuffer``): a subclass of ``array`` that keeps ``array``'s
    ``append``, ``__len__`` and ``__delitem__`` (what the compiled call uses
    where vLLM calls ``append`` and ``len``)."""
    cdef object accepted

    cdef bint accepts(self, object tokens) except -1:
        store_type = type(tokens)
        if store_type is not self.accepted:
            if not (issubclass(store_type, _array)
                    and store_type.append is _array.append
                    and store_type.__len__ is _array.__len__
                    and store_type.__delitem__ is _array.__delitem__):
                return False
            self.accepted = store_type
        return tokens.typecode == "i"


cdef _TokenStore _token_store = _TokenStore()


cdef dict _last_rows(list req_ids):
    """``{req_id: i for i, req_id in enumerate(req_ids)}``: vLLM 0.34's index
    of the runner's rows (the last position of an id that appears twice)."""
    cdef dict rows = {}
    cdef Py_ssize_t i
    for i in range(PyList_GET_SIZE(req_ids)):
        rows[<object>PyList_GET_ITEM(req_ids, i)] = i
    return rows


cdef bint _aligned(list req_ids, dict scheduled) except -1:
    """``req_ids`` lists exactly the scheduled ids in scheduling order (then
    each id's row is its position: the ids of a dict are distinct)."""
    cdef Py_ssize_t pos = 0, i = 0
    cdef PyObject* key
    cdef PyObject* value
    cdef PyObject* item
    if PyList_GET_SIZE(req_ids) != len(scheduled):
        return False
    while PyDict_Next(scheduled, &pos, &key, &value):
        item = PyList_GET_ITEM(req_ids, i)
        if item != key:
            if not (type(<object>item) is str and type(<object>key) is str
                    and <object>item == <object>key):
                return False
        i += 1
    return True


cdef int _mamba_rule(object scheduler) except -2:
    """vLLM 0.34's Mamba condition for caching blocks (``has_mamba_layers and
    not scheduler_config.async_scheduling and cache_config.enable_prefix_caching``):
    1 or 0, or -1 if it cannot be read (a request that needs it goes to vLLM's
    loop, which reads it there)."""
    try:
        if not scheduler.has_mamba_layers:
            return 0
        return 1 if (not scheduler.scheduler_config.async_scheduling
                     and scheduler.cache_config.enable_prefix_caching) else 0
    except Exception:
        return -1


cdef int _classify(dict attrs, object tokens, object drafts, Py_ssize_t num_scheduled,
                   tuple kinds, int variant, Py_ssize_t max_model_len,
                   Py_ssize_t num_spec_tokens, int mamba, _Cache cache, Py_ssize_t row,
                   int logprobs_mode, object cu_rows, Taken* taken) except -1:
    """1 if the request (``attrs``: its instance dict) is a plain decode, with
    its ``drafts`` (the draft ids scheduled, or None), that does not stop this
    step (and ``taken`` holds what the step does to it), 0 if vLLM's loop
    must take it."""
    cdef Py_ssize_t stale, in_flight, placeholders, computed, num_tokens, num_output
    cdef Py_ssize_t max_tokens, min_tokens, num_hashes, cache_upto, start, i
    cdef Py_ssize_t num_new, rejected = 0
    cdef PyObject* mm_features
    cdef PyObject* output_ids
    cdef PyObject* all_ids
    cdef PyObject* hasher
    cdef PyObject* hashes
    if _peek(attrs, "status") != <PyObject*>kinds[1]:
        return 0
    if type(tokens) is not list:
        return 0
    num_new = PyList_GET_SIZE(tokens)
    if drafts is None:
        if num_new != 1:
            return 0
    else:
        # vLLM's loop: the drafts not accepted (of the tokens, all but the
        # one sampled) are rejected; per-request spec metrics go to vLLM.
        if (type(drafts) is not list or num_new < 1
                or num_new - 1 > PyList_GET_SIZE(drafts)
                or _peek(attrs, "spec_decode_metrics") != Py_None):
            return 0
        rejected = PyList_GET_SIZE(drafts) - (num_new - 1)
    if not (_int_at(attrs, "num_stale_output_tokens", &stale) and stale == 0):
        return 0
    if not _int_at(attrs, "num_in_flight_tokens", &in_flight):
        return 0
    mm_features = _peek(attrs, "mm_features")
    if mm_features == NULL or not PyList_CheckExact(mm_features) or Py_SIZE(mm_features) != 0:
        return 0
    if _peek(attrs, "pooling_params") != Py_None or _peek(attrs, "prefill_stats") != Py_None:
        return 0
    params = attrs.get("sampling_params")
    # ``num_logprobs`` (the property, pinned by the guard) is ``logprobs``:
    # no ``logprob_token_ids``.  With sample logprobs, vLLM's loop slices the
    # step's LogprobsLists at its row (``slice_request(row, 1)``).
    if params is None or params.logprob_token_ids:
        return 0
    taken.has_logprobs = False
    if params.logprobs is not None:
        if logprobs_mode == LOGPROBS_LEAVE or num_new != 1:
            return 0
        if logprobs_mode == LOGPROBS_SLICE:
            if cu_rows is None:
                start = row
            elif not (row < PyList_GET_SIZE(cu_rows)
                      and _int_value(<object>PyList_GET_ITEM(cu_rows, row), &start)
                      and start < PY_SSIZE_T_MAX):
                return 0  # vLLM's loop, and its error if any
            taken.logprobs_start = start
            taken.has_logprobs = True
    output_ids = _peek(attrs, "_output_token_ids")
    all_ids = _peek(attrs, "_all_token_ids")
    if output_ids == NULL or not PyList_CheckExact(output_ids) or all_ids == NULL:
        return 0
    cdef bint int_store = not PyList_CheckExact(all_ids)
    if int_store and not _token_store.accepts(<object>all_ids):
        return 0
    # check_stop, after each token is appended: it must say "go on" (the
    # counts only grow: the last token's are checked).
    num_tokens = Py_SIZE(all_ids) + num_new
    num_output = Py_SIZE(output_ids) + num_new
    eos = params._eos_token_id  # the eos_token_id property
    if eos is not None and type(eos) is not int:
        return 0
    stop_ids = params.stop_token_ids
    if stop_ids and type(stop_ids) is not list:
        return 0
    for i in range(num_new):
        token = <object>PyList_GET_ITEM(tokens, i)
        if type(token) is not int or (eos is not None and eos == token) or (
                stop_ids and PySequence_Contains(stop_ids, token)):
            return 0
        if int_store and not INT_MIN <= <object>token <= INT_MAX:
            return 0  # array.append raises in vLLM's loop
    if not _int_at(attrs, "max_tokens", &max_tokens):
        return 0
    if num_tokens >= max_model_len or num_output >= max_tokens:
        return 0
    if not _int_value(params.min_tokens, &min_tokens):
        return 0
    if num_output >= min_tokens and params.repetition_detection is not None:
        return 0
    # update_block_hashes: no new full block to hash.
    hasher = _peek(attrs, "_block_hasher")
    if hasher != NULL and hasher != Py_None:
        hashes = _peek(attrs, "block_hashes")
        if (hashes == NULL or not PyList_CheckExact(hashes)
                or not _hasher.read(<object>hasher, kinds[5])):
            return 0
        num_hashes = Py_SIZE(hashes)
        if (num_hashes + 1) * _hasher.block_size <= num_tokens - _hasher.lookahead:
            return 0
    # The rejected drafts, the placeholders and the block caching of this version.
    if not (_int_at(attrs, "num_output_placeholders", &placeholders)
            and _int_at(attrs, "num_computed_tokens", &computed)):
        return 0
    taken.in_flight = in_flight - num_scheduled
    taken.placeholders = taken.computed = -1
    if rejected:
        if computed > 0:
            computed -= rejected
            taken.computed = computed
        if placeholders > 0:
            placeholders -= rejected
            taken.placeholders = placeholders
    cache_upto = -1
    if variant == PLACEHOLDERS_IN_BASE or variant == ROWS_FROM_REQ_IDS:
        if placeholders > 0:
            if placeholders < num_new:
                return 0  # vLLM's assert fails
            taken.placeholders = placeholders - num_new
        if placeholders > 0 or num_spec_tokens > 0:
            cache_upto = computed - taken.in_flight
        elif variant == ROWS_FROM_REQ_IDS:
            if mamba < 0:
                return 0  # vLLM's loop reads the condition here (and raises)
            if mamba:
                cache_upto = computed - taken.in_flight
    elif variant == ASYNC_OVERRIDE:
        if placeholders < num_new:
            return 0  # vLLM's assert fails
        taken.placeholders = placeholders - num_new
        cache_upto = computed - taken.placeholders
    if cache_upto >= 0 and not cache.is_noop(attrs.get("request_id"), cache_upto):
        return 0
    return 1


def take_decode_outputs(scheduler, scheduler_output, model_runner_output, tuple kinds,
                        int variant, bint drafts=False, accept=None, list refused=None):
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
    global _taken, _left
    if accept is not None and (not callable(accept) or refused is None):
        raise TypeError("accept must be callable and come with a refused list")
    if len(kinds) != 10:
        raise ValueError(f"kinds must have 10 items, got {len(kinds)}")
    output_type, template, logprobs_type, array_type = kinds[6], kinds[7], kinds[8], kinds[9]
    if type(template) is not tuple or len(<tuple>template) != 8:
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
    req_ids = None
    if variant == ROWS_FROM_REQ_IDS:
        req_ids = model_runner_output.req_ids
        if not isinstance(req_ids, list):
            raise TypeError(f"req_ids must be a list, got {type(req_ids).__name__}")
        index_of = {}
    else:
        index_of = model_runner_output.req_id_to_index
    sampled = model_runner_output.sampled_token_ids
    nans = model_runner_output.num_nans_in_logits
    prompt_logprobs = model_runner_output.prompt_logprobs_dict
    prompt_token_logprobs = model_runner_output.prompt_token_id_logprobs_dict
    for name, checked in (("scheduler.requests", requests),
                          ("num_scheduled_tokens", scheduled),
                          ("scheduled_spec_decode_tokens", spec_tokens),
                          ("req_id_to_index", index_of),
                          ("prompt_logprobs_dict", prompt_logprobs),
                          ("prompt_token_id_logprobs_dict", prompt_token_logprobs)):
        if not isinstance(checked, dict):
            raise TypeError(f"{name} must be a dict, got {type(checked).__name__}")
    if not isinstance(sampled, list):
        raise TypeError(f"sampled_token_ids must be a list, got {type(sampled).__name__}")
    if nans is not None and not isinstance(nans, dict):
        raise TypeError(f"num_nans_in_logits must be a dict or None, got {type(nans).__name__}")
    cdef Py_ssize_t max_model_len, num_spec_tokens, num_scheduled, row, count, i, start
    # EngineCoreOutput's positional arguments, and where the fast path's go
    cdef list args
    cdef Py_ssize_t at_id, at_tokens, at_stop, at_events, at_trace, at_nans, at_logprobs
    # (read as vLLM's loop reads them for a request taken; missing: vLLM's loop)
    if not (_int_value(getattr(scheduler, "max_model_len", None), &max_model_len)
            and _int_value(getattr(scheduler, "num_spec_tokens", None), &num_spec_tokens)):
        return None
    cdef int mamba = _mamba_rule(scheduler) if variant == ROWS_FROM_REQ_IDS else 0
    cdef _Cache cache = _Cache()
    if not cache.read(getattr(scheduler, "kv_cache_manager", None), kinds):
        return None
    cdef bint by_position = False
    if variant == ROWS_FROM_REQ_IDS:
        # vLLM 0.34 builds {req_id: i for i, req_id in enumerate(req_ids)}:
        # the position itself when req_ids lists the scheduled ids in order.
        by_position = _aligned(<list>req_ids, <dict>scheduled)
        if not by_position:
            try:
                index_of = _last_rows(<list>req_ids)
            except Exception:
                return None  # an id that cannot be a key: vLLM's error
    # The step's sample logprobs: vLLM slices them for a request with logprobs
    # if they are truthy (a LogprobsLists always is).
    logprobs = model_runner_output.logprobs
    cdef int logprobs_mode = LOGPROBS_LEAVE
    cu_rows = logprob_ids = logprob_values = logprob_ranks = None
    if logprobs is None:
        logprobs_mode = LOGPROBS_NONE
    elif (logprobs_type is not None and type(logprobs) is logprobs_type
          and len(<tuple>logprobs) == 4):
        logprob_ids, logprob_values, logprob_ranks, cu_rows = <tuple>logprobs
        if ((cu_rows is None or type(cu_rows) is list)
                and type(logprob_ids) is array_type and logprob_ids.ndim >= 1
                and type(logprob_values) is array_type and logprob_values.ndim >= 1
                and type(logprob_ranks) is array_type and logprob_ranks.ndim >= 1):
            logprobs_mode = LOGPROBS_SLICE
    cdef Py_ssize_t num_requests = len(<dict>scheduled)
    cdef Taken* taken = <Taken*>PyMem_Malloc(max(num_requests, 1) * sizeof(Taken))
    if taken == NULL:
        raise MemoryError()
    cdef list slots = [None] * num_requests
    cdef list taken_requests = []
    cdef list grammars = []  # (id, request) of each request taken with a grammar
    cdef Py_ssize_t num_refused = 0, num_grammars = 0
    cdef bint has_grammar
    cdef dict rest = {}
    cdef Py_ssize_t pos = 0
    cdef PyObject* key
    cdef PyObject* value
    cdef dict attrs
    cdef PyObject* client_index
    cdef bint is_request
    cdef ScheduledPrefetch prefetch
    try:
        # Pass 1: read and classify; nothing is changed.
        count = 0
        i = 0
        prefetch = ScheduledPrefetch(scheduled, requests, kinds[0])
        while PyDict_Next(scheduled, &pos, &key, &value):
            prefetch.advance(i)
            req_id = <object>key
            num_obj = <object>value
            if type(req_id) is not str:
                return None  # the slots tell ids (str) from outputs by type
            request = (<dict>requests).get(req_id)
            # Requests are read and written through their instance dict: every
            # attribute used is a plain instance attribute (checked on activation).
            is_request = type(request) is kinds[0]
            if is_request:
                attrs = PyObject_GenericGetDict(request, NULL)
                client_index = _peek(attrs, "client_index")
                if client_index == NULL or <object>client_index != 0:
                    return None  # outputs of several front-ends: vLLM's loop orders them
            elif request is not None and request.client_index != 0:
                return None
            request_drafts = (<dict>spec_tokens).get(req_id) or None
            has_grammar = is_request and _peek(attrs, "structured_output_request") != Py_None
            if has_grammar and (accept is None or request_drafts is not None):
                # A grammar to advance, and no accept_tokens to advance it
                # with (or drafts): vLLM's loop, told before anything else of
                # the request is read.
                slots[i] = req_id
                rest[req_id] = num_obj
                i += 1
                continue
            if (request is None or not _int_value(num_obj, &num_scheduled)
                    or num_scheduled <= 0
                    or (request_drafts is not None and not drafts)
                    or (nans is not None and req_id in <dict>nans)
                    or req_id in <dict>prompt_logprobs
                    or req_id in <dict>prompt_token_logprobs):
                slots[i] = req_id
                rest[req_id] = num_obj
                i += 1
                continue
            tokens = None
            if by_position:
                row = i
                if row < PyList_GET_SIZE(sampled):
                    tokens = <object>PyList_GET_ITEM(sampled, row)
            else:
                row_obj = (<dict>index_of).get(req_id)
                if (type(row_obj) is int and _int_value(row_obj, &row)
                        and 0 <= row < PyList_GET_SIZE(sampled)):
                    tokens = <object>PyList_GET_ITEM(sampled, row)
            if tokens is not None and is_request:
                if _classify(attrs, tokens, request_drafts, num_scheduled, kinds, variant,
                             max_model_len, num_spec_tokens, mamba, cache, row,
                             logprobs_mode, cu_rows, &taken[count]):
                    taken[count].has_grammar = has_grammar
                    if has_grammar:
                        grammars.append((req_id, request))
                    slots[i] = tokens  # the request's sampled list, for pass 2
                    taken_requests.append(attrs)
                    count += 1
                    i += 1
                    continue
            slots[i] = req_id
            rest[req_id] = num_obj
            i += 1
        if count == 0:
            return None
        # Pass 2: what vLLM's loop does to each request taken, and its output.
        args = list(<tuple>template[0])
        at_id, at_tokens, at_stop, at_events, at_trace, at_nans, at_logprobs = template[1:]
        for i in (at_id, at_tokens, at_stop, at_events, at_trace, at_nans, at_logprobs):
            if not 0 <= i < PyList_GET_SIZE(args):
                raise ValueError(f"kinds[7]: position {i} is outside the "
                                 f"{PyList_GET_SIZE(args)} template arguments")
        count = 0
        for i in range(num_requests):
            tokens = slots[i]
            if type(tokens) is not list:
                continue
            attrs = <dict>taken_requests[count]
            if taken[count].has_grammar:
                undo = (attrs["num_in_flight_tokens"], attrs["num_computed_tokens"],
                        attrs["num_output_placeholders"])
            attrs["num_in_flight_tokens"] = taken[count].in_flight
            output_ids, all_ids = attrs["_output_token_ids"], attrs["_all_token_ids"]
            if type(all_ids) is list:
                for token in <list>tokens:
                    PyList_Append(output_ids, token)
                    PyList_Append(all_ids, token)
            else:  # an array('i') (TokenBuffer): appended as vLLM appends
                for token in <list>tokens:
                    PyList_Append(output_ids, token)
                    _ARRAY_APPEND(all_ids, token)
            if taken[count].computed >= 0:
                attrs["num_computed_tokens"] = taken[count].computed
            if taken[count].placeholders >= 0:
                attrs["num_output_placeholders"] = taken[count].placeholders
            if taken[count].has_grammar:
                req_id, request = <tuple>grammars[num_grammars]
                num_grammars += 1
                if not accept(request, tokens):
                    # vLLM's loop stops it with an error: it gets the request
                    # as it was (the caller has it see the same answer).
                    (attrs["num_in_flight_tokens"], attrs["num_computed_tokens"],
                     attrs["num_output_placeholders"]) = undo
                    del (<list>output_ids)[-len(<list>tokens):]
                    del all_ids[-len(<list>tokens):]
                    slots[i] = req_id
                    refused.append(req_id)
                    num_refused += 1
                    count += 1
                    continue
            events = attrs.get("events")
            if events:
                attrs["events"] = []
            else:
                events = None
            args[at_id] = attrs.get("request_id")
            args[at_tokens] = tokens
            args[at_stop] = attrs.get("stop_reason")
            args[at_events] = events
            args[at_trace] = attrs.get("trace_headers")
            args[at_nans] = attrs.get("num_nans_in_logits")
            if taken[count].has_logprobs:
                # LogprobsLists.slice_request(row, 1): the same slice of each array.
                start = taken[count].logprobs_start
                rows = PySlice_New(start, start + 1, None)
                args[at_logprobs] = _named_tuple4(
                    logprobs_type, logprob_ids[rows], logprob_values[rows],
                    logprob_ranks[rows], None)
            else:
                args[at_logprobs] = None
            slots[i] = output_type(*args)
            count += 1
        if num_refused:
            # vLLM's loop takes the requests left in scheduling order.
            rest = {req_id: (<dict>scheduled)[req_id] for req_id in slots
                    if type(req_id) is str}
        _taken += count - num_refused
        _left += len(rest)
        return slots, rest
    finally:
        PyMem_Free(taken)


def merge_decode_outputs(list slots, list stock_outputs):
    """The step's outputs in scheduling order: each slot's own output, or for a
    request id, vLLM's output for it if its loop made one; then any outputs of
    vLLM's left over (those its loop adds after the requests, in order)."""
    cdef list merged = []
    cdef Py_ssize_t j = 0, num_stock = len(stock_outputs)
    for slot in slots:
        if type(slot) is str:
            if j < num_stock and stock_outputs[j].request_id == slot:
                merged.append(stock_outputs[j])
                j += 1
        else:
            merged.append(slot)
    merged.extend(stock_outputs[j:])
    return merged
