# Compiler directives are set in setup.py (one place, with a debug switch).
"""Compiled piece ``scheduler``: is vLLM's ``KVCacheManager.allocate_slots`` a no-op here?

The same decision as ``fastbatch._reference.decode_slots`` (see its module
note for why each condition), read with C-level type checks and dict
lookups.  It reads and never writes.
"""

from libc.stdint cimport uint64_t

cdef uint64_t _noop_allocations = 0
cdef uint64_t _stock_allocations = 0


def stats():
    """This piece's counters since import or the last ``reset_stats()``."""
    return {"scheduler_noop_allocations": _noop_allocations,
            "scheduler_stock_allocations": _stock_allocations}


def reset_stats():
    """Set every counter of ``stats()`` back to zero."""
    global _noop_allocations, _stock_allocations
    _noop_allocations = _stock_allocations = 0


cdef bint _is_noop(object manager, object request, object num_new_tokens,
                   object reserved_blocks, tuple kinds) except -1:
    manager_type, coordinator_types, single_type, running = kinds
    if type(manager) is not manager_type:
        return False
    coordinator = manager.coordinator
    if type(coordinator) not in coordinator_types:
        return False
    singles = coordinator.single_type_managers
    if type(singles) is not tuple or len(<tuple>singles) != 1:
        return False
    single = (<tuple>singles)[0]
    if type(single) is not single_type or request.status is not running:
        return False
    request_id = request.request_id
    req_to_blocks = single.req_to_blocks
    if not isinstance(req_to_blocks, dict):
        return False
    blocks = (<dict>req_to_blocks).get(request_id)
    if type(blocks) is not list or request_id in single._partial_hit_reqs:
        return False
    num_computed = request.num_computed_tokens
    max_model_len_obj = manager.max_model_len
    block_size_obj = single.block_size
    if (type(num_new_tokens) is not int or type(reserved_blocks) is not int
            or type(num_computed) is not int or type(max_model_len_obj) is not int
            or type(block_size_obj) is not int):
        return False
    # Values beyond Py_ssize_t raise OverflowError: not a case vLLM produces.
    cdef Py_ssize_t new_tokens = num_new_tokens
    cdef Py_ssize_t computed = num_computed
    cdef Py_ssize_t max_model_len = max_model_len_obj
    cdef Py_ssize_t block_size = block_size_obj
    cdef Py_ssize_t reserved = reserved_blocks
    if new_tokens <= 0 or block_size <= 0 or computed < 0:
        return False
    cdef Py_ssize_t total_computed = min(computed, max_model_len)
    cdef Py_ssize_t need_slots = min(total_computed + new_tokens, max_model_len)
    if need_slots < 0:
        return False
    # vLLM's cdiv, for a count >= 0 and a block size > 0.
    if (need_slots + block_size - 1) // block_size > len(<list>blocks):
        return False
    pool = single.block_pool
    if pool is not manager.block_pool or reserved > pool.get_num_free_blocks():
        return False
    cdef Py_ssize_t hash_block_size, to_cache, cacheable
    if single.enable_caching:
        hash_block_size = pool.hash_block_size
        if block_size != hash_block_size:
            return False
        if single.kv_cache_spec.prefix_cacheable:
            to_cache = min(total_computed + new_tokens, <Py_ssize_t>request.num_tokens)
            cacheable = max(0, to_cache - <Py_ssize_t>coordinator.num_reprefillable_tokens)
            # vLLM 0.32.0's count of full blocks; 0.33.0's is never larger.
            if <Py_ssize_t>single.num_cached_block.get(request_id, 0) < cacheable // block_size:
                return False
    return True


def allocate_slots_is_noop(manager, request, num_new_tokens, reserved_blocks, tuple kinds):
    """True if vLLM's ``manager.allocate_slots(request, num_new_tokens,
    reserved_blocks=reserved_blocks)`` would return ``empty_kv_cache_blocks``
    and change no state (see ``fastbatch._reference.decode_slots``).

    ``kinds`` is ``(KVCacheManager, (coordinator types...),
    FullAttentionManager, RequestStatus.RUNNING)`` of the vLLM in use.
    """
    global _noop_allocations, _stock_allocations
    if len(kinds) != 4:
        raise ValueError(f"kinds must have 4 items, got {len(kinds)}")
    if _is_noop(manager, request, num_new_tokens, reserved_blocks, kinds):
        _noop_allocations += 1
        return True
    _stock_allocations += 1
    return False
