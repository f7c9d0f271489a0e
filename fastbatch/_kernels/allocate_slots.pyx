# Compiler directives are set in setup.py (one place, with a debug switch).
"""Compiled piece ``allocate_slots``: vLLM's ``KVCacheManager.allocate_slots`` for a decode, in C.

``allocate_slots`` is the method itself, bound on vLLM's class by the patch
(a Cython function binds like a Python one: ``binding`` is on, Cython 3's
default), with vLLM's signature and defaults.  One compiled call checks the
defaults (``num_lookahead_tokens`` may be any count: spec decoding's
lookahead slots) and plans what vLLM's method would do (``_plan``): nothing
(it returns ``empty_kv_cache_blocks``), or new blocks and/or caching, which
it then asks of vLLM's own coordinator with vLLM's arguments, leaving out
the calls that would do nothing; any call it cannot plan goes to vLLM's
method (``bind``) with every argument as it came.  The plan is the one of
``fastbatch._reference.allocate_slots`` (see its module note for why each
condition), read with C-level type checks, dict lookups and reads of the
fields that the pinned vLLM methods and properties would return (no Python
call on the common path).  The plan reads and never writes.

``allocate_slots_is_noop`` is the decision alone, with the kinds passed in.
"""

__all__ = ["allocate_slots_is_noop"]

cimport cython
from libc.stdint cimport uint64_t

from fastbatch._kernels._common cimport as_index

cdef uint64_t _noop_allocations = 0
cdef uint64_t _noop_lookahead_allocations = 0
cdef uint64_t _direct_allocations = 0
cdef uint64_t _stock_allocations = 0


def stats():
    """This piece's counters since import or the last ``reset_stats()``."""
    return {"noop_allocations": _noop_allocations,
            "noop_lookahead_allocations": _noop_lookahead_allocations,
            "direct_allocations": _direct_allocations,
            "stock_allocations": _stock_allocations}


def reset_stats():
    """Set every counter of ``stats()`` back to zero."""
    global _noop_allocations, _noop_lookahead_allocations, _direct_allocations
    global _stock_allocations
    _noop_allocations = _noop_lookahead_allocations = _direct_allocations = 0
    _stock_allocations = 0


@cython.final
cdef class _Kinds:
    """vLLM's classes on the fast path (see ``bind``), unpacked once."""

    # Types (object: vLLM's have metaclasses, which a ``type`` field refuses).
    cdef object manager
    cdef tuple coordinators
    cdef object single
    cdef object pool
    cdef object request
    cdef object spec
    cdef object running


cdef _Kinds _unpack_kinds(object kinds):
    if not isinstance(kinds, tuple):
        raise TypeError(f"kinds must be a tuple, got {type(kinds).__name__}")
    if len(<tuple>kinds) != 7:
        raise ValueError(f"kinds must have 7 items, got {len(<tuple>kinds)}")
    manager, coordinators, single, pool, request, spec, running = <tuple>kinds
    if not isinstance(coordinators, tuple):
        raise TypeError(f"kinds[1] must be a tuple of types, got {type(coordinators).__name__}")
    for position, kind in enumerate((manager, *coordinators, single, pool, request, spec)):
        if not isinstance(kind, type):
            raise TypeError(f"kinds must hold types (and RUNNING last), got "
                            f"{type(kind).__name__} at {position}")
    cdef _Kinds unpacked = _Kinds.__new__(_Kinds)
    unpacked.manager, unpacked.coordinators, unpacked.single = manager, coordinators, single
    unpacked.pool, unpacked.request, unpacked.spec = pool, request, spec
    unpacked.running = running
    return unpacked


# Set by bind(): vLLM's own method and the kinds of the vLLM in use.
cdef object _stock = None
cdef _Kinds _bound_kinds = None


def bind(stock, kinds):
    """Make ``allocate_slots`` answer for this vLLM: ``stock`` is vLLM's own
    ``KVCacheManager.allocate_slots`` (every call that is not a no-op goes
    there), ``kinds`` as for ``allocate_slots_is_noop``."""
    global _stock, _bound_kinds
    if not callable(stock):
        raise TypeError(f"stock must be callable, got {type(stock).__name__}")
    _bound_kinds = _unpack_kinds(kinds)
    _stock = stock


cdef inline bint _is_int_zero(object value) noexcept:
    cdef Py_ssize_t number
    return as_index(value, &number) and number == 0


cdef class _Manager:
    """What ``_plan`` reads of a KV-cache manager that is the same for every
    request (see the .pxd), read once by ``manager_view``."""

    def __cinit__(self):
        self.manager = self.coordinator = self.req_to_blocks = self.partial_hits = None
        self.cached = self.pool = self.free_queue = None


cdef _Manager _view(object manager, _Kinds kinds):
    """``manager`` as ``_plan`` reads it, or None where vLLM's method decides
    every call (not the plain classes, one full-attention group, ints...)."""
    cdef Py_ssize_t max_model_len, block_size, hash_block_size, reprefillable = 0
    if type(manager) is not kinds.manager:
        return None
    coordinator = manager.coordinator
    coordinator_type = type(coordinator)
    for kind in kinds.coordinators:
        if coordinator_type is kind:
            break
    else:
        return None
    singles = coordinator.single_type_managers
    if type(singles) is not tuple or len(<tuple>singles) != 1:
        return None
    single = (<tuple>singles)[0]
    if type(single) is not kinds.single:
        return None
    req_to_blocks = single.req_to_blocks
    if not isinstance(req_to_blocks, dict):
        return None
    if not (as_index(manager.max_model_len, &max_model_len)
            and as_index(single.block_size, &block_size)) or block_size <= 0:
        return None
    pool = single.block_pool
    if pool is not manager.block_pool:
        return None
    cdef bint caching = False
    cached = None
    if single.enable_caching:
        if not as_index(pool.hash_block_size, &hash_block_size):
            return None
        if block_size != hash_block_size:
            return None
        spec = single.kv_cache_spec
        # The pinned KVCacheSpec.prefix_cacheable of vLLM's full-attention spec is True.
        if type(spec) is kinds.spec or spec.prefix_cacheable:
            if not as_index(coordinator.num_reprefillable_tokens, &reprefillable):
                return None
            cached = single.num_cached_block
            if not isinstance(cached, dict):
                return None
            caching = True
    cdef _Manager view = _Manager.__new__(_Manager)
    view.manager, view.coordinator, view.req_to_blocks = manager, coordinator, req_to_blocks
    view.partial_hits, view.cached, view.pool = single._partial_hit_reqs, cached, pool
    view.exact_pool = type(pool) is kinds.pool
    view.free_queue = pool.free_block_queue if view.exact_pool else None
    view.max_model_len, view.block_size = max_model_len, block_size
    view.reprefillable = reprefillable
    view.caching = caching
    return view


cdef int _plan(_Manager view, object request, Py_ssize_t new_tokens, Py_ssize_t reserved,
               Py_ssize_t lookahead, _Kinds kinds, _Counts* counts) except -2:
    """What vLLM's method would do for this decode call (``_STOCK``: it
    decides), with the counts of its two calls."""
    cdef Py_ssize_t computed, free_blocks, num_tokens, num_cached, block_size
    cdef Py_ssize_t total_computed, need_slots, cacheable, to_cache, blocks_needed
    cdef int plan = _NOTHING
    if request.status is not kinds.running:
        return _STOCK
    request_id = request.request_id
    blocks = (<dict>view.req_to_blocks).get(request_id)
    if type(blocks) is not list or request_id in view.partial_hits:
        return _STOCK
    if not as_index(request.num_computed_tokens, &computed):
        return _STOCK
    block_size = view.block_size
    if new_tokens <= 0 or computed < 0:
        return _STOCK
    total_computed = min(computed, view.max_model_len)
    # Every count is below 2**30: no overflow.  The lookahead slots count
    # towards the blocks needed, not towards the tokens to cache.
    need_slots = min(total_computed + new_tokens + lookahead, view.max_model_len)
    if need_slots < 0:
        return _STOCK
    # vLLM's cdiv, for a count >= 0 and a block size > 0.
    blocks_needed = (need_slots + block_size - 1) // block_size - len(<list>blocks)
    # BlockPool.get_num_free_blocks (pinned) returns this field.
    free = (view.free_queue.num_free_blocks if view.exact_pool
            else view.pool.get_num_free_blocks())
    if not as_index(free, &free_blocks):
        return _STOCK
    if blocks_needed > 0:
        plan = _ALLOCATE
    else:
        blocks_needed = 0
    if blocks_needed + reserved > free_blocks:
        return _STOCK  # vLLM returns None
    if view.caching:
        if type(request) is kinds.request:
            # Request.num_tokens (pinned) is the length of this list.
            num_tokens = len(request._all_token_ids)
        elif not as_index(request.num_tokens, &num_tokens):
            return _STOCK
        if not as_index((<dict>view.cached).get(request_id, 0), &num_cached):
            return _STOCK
        to_cache = min(total_computed + new_tokens, num_tokens)
        cacheable = max(0, to_cache - view.reprefillable)
        # vLLM 0.32.0's count of full blocks; 0.33.0's is never larger.
        if num_cached < cacheable // block_size:
            plan |= _CACHE
            counts.to_cache = to_cache
    counts.need_slots = need_slots
    counts.main_tokens = total_computed + new_tokens
    return plan


cdef int _plan_call(object manager, object request, object num_new_tokens,
                    object reserved_blocks, Py_ssize_t lookahead, _Kinds kinds,
                    _Counts* counts) except -2:
    """``_plan`` for one call on ``manager``."""
    cdef Py_ssize_t new_tokens, reserved
    if not (as_index(num_new_tokens, &new_tokens) and as_index(reserved_blocks, &reserved)):
        return _STOCK
    view = _view(manager, kinds)
    if view is None:
        return _STOCK
    return _plan(view, request, new_tokens, reserved, lookahead, kinds, counts)


def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0,
                   new_computed_blocks=None, num_lookahead_tokens=0,
                   num_external_computed_tokens=0, delay_cache_blocks=False,
                   num_encoder_tokens=0, full_sequence_must_fit=False, reserved_blocks=0,
                   has_scheduled_reqs=True, skip_zeroing_group_ids=()):
    """fastbatch's ``KVCacheManager.allocate_slots`` (vLLM's signature and defaults).

    For a running request's decode call (every argument but
    ``num_new_tokens``, ``num_lookahead_tokens`` (an int >= 0) and
    ``reserved_blocks`` at its default; ``has_scheduled_reqs`` and
    ``skip_zeroing_group_ids`` do not matter for a running request without
    new computed blocks) that ``_plan`` can follow: ``self.empty_kv_cache_blocks``
    where vLLM's method would return it and change nothing
    (``allocate_slots_is_noop``); else the two calls of vLLM's method that
    act, with its arguments: the coordinator's ``allocate_new_blocks`` where
    blocks are needed, then its ``cache_blocks`` where full blocks are left
    to cache, and the result of ``create_kv_cache_blocks``.  vLLM's method
    (``bind``) with the same arguments for every other call.
    """
    global _stock_allocations
    cdef Py_ssize_t lookahead = 0
    cdef int plan = _STOCK
    cdef _Counts counts
    if _stock is None:
        raise RuntimeError("fastbatch's allocate_slots is not bound to vLLM's method "
                           "(fastbatch.patches.allocate_slots.bind() does it)")
    if (new_computed_blocks is None and _is_int_zero(num_new_computed_tokens)
            and as_index(num_lookahead_tokens, &lookahead) and lookahead >= 0
            and _is_int_zero(num_external_computed_tokens)
            and _is_int_zero(num_encoder_tokens) and delay_cache_blocks is False
            and full_sequence_must_fit is False):
        plan = _plan_call(self, request, num_new_tokens, reserved_blocks, lookahead,
                          _bound_kinds, &counts)
    if plan == _STOCK:
        _stock_allocations += 1
        return _stock(self, request, num_new_tokens, num_new_computed_tokens,
                      new_computed_blocks, num_lookahead_tokens,
                      num_external_computed_tokens, delay_cache_blocks, num_encoder_tokens,
                      full_sequence_must_fit, reserved_blocks, has_scheduled_reqs,
                      skip_zeroing_group_ids)
    return _act(self, request, plan, lookahead, &counts, num_encoder_tokens)


cdef object _act(object manager, object request, int plan, Py_ssize_t lookahead,
                 _Counts* counts, object num_encoder_tokens):
    """What vLLM's method does for a call that ``_plan`` took (``plan`` is not
    ``_STOCK``): nothing, or the coordinator's two calls; counted."""
    global _noop_allocations, _noop_lookahead_allocations, _direct_allocations
    if plan == _NOTHING:
        _noop_allocations += 1
        if lookahead:
            _noop_lookahead_allocations += 1
        return manager.empty_kv_cache_blocks
    _direct_allocations += 1
    coordinator = manager.coordinator
    new_blocks = None
    if plan & _ALLOCATE:
        new_blocks = coordinator.allocate_new_blocks(request.request_id, counts.need_slots,
                                                     counts.main_tokens, num_encoder_tokens)
    if plan & _CACHE:
        coordinator.cache_blocks(request, counts.to_cache)
    if new_blocks is None:
        return manager.empty_kv_cache_blocks
    return manager.create_kv_cache_blocks(new_blocks)


cdef _Manager manager_view(object manager):
    """``manager`` as the plan of its decode calls reads it (``allocate_decode``),
    or None where vLLM's method decides every call (or nothing is bound)."""
    if _bound_kinds is None:
        return None
    return _view(manager, _bound_kinds)


cdef object allocate_decode(_Manager view, object request, Py_ssize_t num_new_tokens,
                            Py_ssize_t num_lookahead_tokens, bint act):
    """The scheduler's decode call ``manager.allocate_slots(request,
    num_new_tokens, num_lookahead_tokens=num_lookahead_tokens)`` on the
    manager of ``view`` (``manager_view``), every other argument at its
    default (``num_lookahead_tokens``: the scheduler's, read by the caller
    once, at least 0): None (nothing done) where vLLM's method is needed;
    else, with ``act``, what ``allocate_slots`` returns for it (and counts),
    without, True (nothing done: the call will not return None)."""
    cdef _Counts counts
    plan = _plan(view, request, num_new_tokens, 0, num_lookahead_tokens, _bound_kinds,
                 &counts)
    if plan == _STOCK:
        return None
    if not act:
        return True
    return _act(view.manager, request, plan, num_lookahead_tokens, &counts, 0)


def allocate_slots_is_noop(manager, request, num_new_tokens, reserved_blocks, kinds,
                           num_lookahead_tokens=0):
    """True if vLLM's ``manager.allocate_slots(request, num_new_tokens,
    reserved_blocks=reserved_blocks, num_lookahead_tokens=num_lookahead_tokens)``
    would return ``empty_kv_cache_blocks`` and change no state.
    ``num_lookahead_tokens`` must be an exact int from 0 to 2**30 - 1, as
    vLLM's scheduler passes (else the answer is False).

    ``kinds`` is ``(KVCacheManager, (coordinator types...),
    FullAttentionManager, BlockPool, Request, FullAttentionSpec,
    RequestStatus.RUNNING)`` of the vLLM in use.  Counted as
    ``allocate_slots`` counts its calls.
    """
    global _noop_allocations, _noop_lookahead_allocations, _stock_allocations
    cdef Py_ssize_t lookahead = 0
    cdef _Kinds unpacked = _unpack_kinds(kinds)
    cdef _Counts counts
    if (as_index(num_lookahead_tokens, &lookahead) and lookahead >= 0
            and _plan_call(manager, request, num_new_tokens, reserved_blocks, lookahead,
                           unpacked, &counts) == _NOTHING):
        _noop_allocations += 1
        if lookahead:
            _noop_lookahead_allocations += 1
        return True
    _stock_allocations += 1
    return False
