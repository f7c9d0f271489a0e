"""Pure-Python twin of the compiled piece ``scheduler`` (``fastbatch._kernels.decode_slots``).

``allocate_slots_is_noop`` says whether vLLM's ``KVCacheManager.allocate_slots``,
called for ``request`` with ``num_new_tokens`` and every other argument at its
default (``reserved_blocks`` aside), would return ``empty_kv_cache_blocks``
and change nothing: no block to allocate, free, or cache.  That is the case
of a running request in a plain decode step that stays inside its last block
(15 steps out of 16 with blocks of 16 tokens).  It answers False whenever it
cannot be sure, and the caller then runs vLLM's own code.

Why each condition (read off vLLM 0.33.0's code, pinned by the patch's guard):

- ``type(manager)``, the coordinator's and the single-type manager's types
  are exactly vLLM's plain ones (one full-attention group, unitary or
  no-prefix-cache coordinator), so no override changes the path;
- the request is RUNNING (no watermark) and already holds a block list
  (``req_to_blocks`` is a defaultdict: a missing entry would be created) and
  no pending partial-hit copy-on-write;
- ``cdiv(min(computed + new, max_model_len), block_size)`` blocks are
  already held (``get_num_blocks_to_allocate`` is 0, ``allocate_new_blocks``
  adds none), and ``reserved_blocks`` does not exceed the free blocks (else
  stock returns None);
- with caching on, ``block_size == hash_block_size`` (no partial-tail
  caching) and the full blocks of cacheable tokens are all cached already
  (``cache_blocks`` returns early).  vLLM 0.32.0 counts every full block of
  cacheable tokens, 0.33.0 only those whose hashes exist (never more): the
  0.32.0 count is used for both, so a yes is right for either.
"""

from __future__ import annotations

from typing import Any

from fastbatch._reference._common import Counters

_COUNTERS = Counters(("scheduler_noop_allocations", "scheduler_stock_allocations"))
stats, reset_stats = _COUNTERS.stats, _COUNTERS.reset_stats


def _is_noop(manager: Any, request: Any, num_new_tokens: Any, reserved_blocks: Any,
             kinds: tuple[Any, Any, Any, Any]) -> bool:
    manager_type, coordinator_types, single_type, running = kinds
    if type(manager) is not manager_type:
        return False
    coordinator = manager.coordinator
    if type(coordinator) not in coordinator_types:
        return False
    singles = coordinator.single_type_managers
    if type(singles) is not tuple or len(singles) != 1:
        return False
    single = singles[0]
    if type(single) is not single_type or request.status is not running:
        return False
    request_id = request.request_id
    req_to_blocks = single.req_to_blocks
    if not isinstance(req_to_blocks, dict):
        return False
    blocks = req_to_blocks.get(request_id)
    if type(blocks) is not list or request_id in single._partial_hit_reqs:
        return False
    num_computed = request.num_computed_tokens
    max_model_len = manager.max_model_len
    block_size = single.block_size
    if not all(type(value) is int for value in (num_new_tokens, reserved_blocks,
                                                num_computed, max_model_len, block_size)):
        return False
    if num_new_tokens <= 0 or block_size <= 0 or num_computed < 0:
        return False
    total_computed = min(num_computed, max_model_len)
    need_slots = min(total_computed + num_new_tokens, max_model_len)
    if need_slots < 0:
        return False
    # vLLM's cdiv, for a count >= 0 and a block size > 0.
    if (need_slots + block_size - 1) // block_size > len(blocks):
        return False
    pool = single.block_pool
    if pool is not manager.block_pool or reserved_blocks > pool.get_num_free_blocks():
        return False
    if single.enable_caching:
        hash_block_size = pool.hash_block_size
        if block_size != hash_block_size:
            return False
        if single.kv_cache_spec.prefix_cacheable:
            to_cache = min(total_computed + num_new_tokens, request.num_tokens)
            cacheable = max(0, to_cache - coordinator.num_reprefillable_tokens)
            num_full = cacheable // block_size
            if single.num_cached_block.get(request_id, 0) < num_full:
                return False
    return True


def allocate_slots_is_noop(manager: Any, request: Any, num_new_tokens: Any,
                           reserved_blocks: Any, kinds: tuple[Any, Any, Any, Any]) -> bool:
    """True if vLLM's ``manager.allocate_slots(request, num_new_tokens,
    reserved_blocks=reserved_blocks)`` would return ``empty_kv_cache_blocks``
    and change no state.

    ``kinds`` is ``(KVCacheManager, (coordinator types...),
    FullAttentionManager, RequestStatus.RUNNING)`` of the vLLM in use.
    """
    if not isinstance(kinds, tuple):
        raise TypeError(f"kinds must be a tuple, got {type(kinds).__name__}")
    if len(kinds) != 4:
        raise ValueError(f"kinds must have 4 items, got {len(kinds)}")
    noop = _is_noop(manager, request, num_new_tokens, reserved_blocks, kinds)
    _COUNTERS.values["scheduler_noop_allocations" if noop
                     else "scheduler_stock_allocations"] += 1
    return noop
