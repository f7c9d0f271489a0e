"""Pure-Python twin of the compiled piece ``allocate_slots`` (``fastbatch._kernels``).

``allocate_slots`` is vLLM's ``KVCacheManager.allocate_slots`` (same
signature and defaults) planning a running request's decode call itself
(``_plan``): it returns ``self.empty_kv_cache_blocks`` where
``allocate_slots_is_noop`` says yes; where only new blocks and/or a
completed block to cache are left, it makes the two calls of vLLM's method
that act there, the coordinator's ``allocate_new_blocks(request_id,
num_tokens_need_slot, num_tokens_main_model, num_encoder_tokens)`` and
``cache_blocks(request, num_tokens_to_cache)``, with vLLM's counts, and
returns ``create_kv_cache_blocks`` of the new blocks (or
``empty_kv_cache_blocks``); with ``n`` blocks to add, vLLM needs ``n +
reserved_blocks`` free blocks (else it returns None, and that call goes to
vLLM).  Every other call goes to vLLM's method (``bind``) with the same
arguments.

``allocate_slots_is_noop`` says whether vLLM's ``KVCacheManager.allocate_slots``,
called for ``request`` with ``num_new_tokens``, ``num_lookahead_tokens`` and
every other argument at its default (``reserved_blocks`` aside), would return
``empty_kv_cache_blocks`` and change nothing: no block to allocate, free, or
cache.  That is the case of a running request in a decode step that stays
inside the blocks it holds: a plain decode (15 steps out of 16 with blocks of
16 tokens), or with spec decoding a step whose new tokens (the last sampled
one and the drafts to verify) and lookahead slots all fit in the blocks
already allocated, and that completes no block of committed tokens.  It
answers False whenever it cannot be sure, and the caller then runs vLLM's own
code.

Why each condition (read off vLLM 0.33.0's code, pinned by the patch's guard):

- ``type(manager)``, the coordinator's and the single-type manager's types
  are exactly vLLM's plain ones (one full-attention group, unitary or
  no-prefix-cache coordinator), so no override changes the path;
- the request is RUNNING (no watermark) and already holds a block list
  (``req_to_blocks`` is a defaultdict: a missing entry would be created) and
  no pending partial-hit copy-on-write;
- ``cdiv(min(computed + new + lookahead, max_model_len), block_size)``
  blocks are already held (``get_num_blocks_to_allocate`` is 0,
  ``allocate_new_blocks`` adds none), and ``reserved_blocks`` does not exceed
  the free blocks (else stock returns None); ``num_lookahead_tokens`` is an
  int >= 0 (vLLM's scheduler passes its ``num_lookahead_tokens``: 0 without
  spec decoding), and only this count sees it;
- with caching on, ``block_size == hash_block_size`` (no partial-tail
  caching) and the full blocks of cacheable tokens are all cached already
  (``cache_blocks`` returns early): the tokens to cache are
  ``min(computed + new, request.num_tokens)`` (drafts and lookahead slots
  are never cached; a step whose accepted tokens completed a block does
  cache it: that call is planned).  vLLM 0.32.0 counts every full block of
  cacheable tokens, 0.33.0 only those whose hashes exist (never more): the
  0.32.0 count is used for both, so a yes is right for either.

Where the kinds pin vLLM's own classes, the compiled piece reads the fields
that vLLM's pinned accessors return instead of calling them:
``BlockPool.get_num_free_blocks`` is ``free_block_queue.num_free_blocks``,
``Request.num_tokens`` is ``len(_all_token_ids)``, and
``FullAttentionSpec.prefix_cacheable`` is ``True``.  Every count must be an
exact int of one CPython digit (below 2**30 in size, as every count here is);
anything else is not a no-op and vLLM's code decides.
"""

from __future__ import annotations

__all__ = ["allocate_slots_is_noop"]

from types import SimpleNamespace
from typing import Any

from fastbatch._reference._common import Counters

_COUNTERS = Counters(("noop_allocations", "noop_lookahead_allocations",
                      "direct_allocations", "stock_allocations"))
stats, reset_stats = _COUNTERS.stats, _COUNTERS.reset_stats

# The compiled piece reads counts as one-digit ints (CPython's compact ints).
_INDEX_LIMIT = 1 << 30

# Set by bind(): vLLM's own method, and the kinds of the vLLM in use.
_BOUND: tuple[Any, tuple[Any, ...]] | None = None


def _unpack_kinds(kinds: Any) -> tuple[Any, ...]:
    if not isinstance(kinds, tuple):
        raise TypeError(f"kinds must be a tuple, got {type(kinds).__name__}")
    if len(kinds) != 7:
        raise ValueError(f"kinds must have 7 items, got {len(kinds)}")
    manager, coordinators, single, pool, request, spec, _running = kinds
    if not isinstance(coordinators, tuple):
        raise TypeError(f"kinds[1] must be a tuple of types, got {type(coordinators).__name__}")
    for position, kind in enumerate((manager, *coordinators, single, pool, request, spec)):
        if not isinstance(kind, type):
            raise TypeError(f"kinds must hold types (and RUNNING last), got "
                            f"{type(kind).__name__} at {position}")
    return kinds


def bind(stock: Any, kinds: Any) -> None:
    """Make ``allocate_slots`` answer for this vLLM: ``stock`` is vLLM's own
    ``KVCacheManager.allocate_slots`` (every call that is not a no-op goes
    there), ``kinds`` as for ``allocate_slots_is_noop``."""
    global _BOUND
    if not callable(stock):
        raise TypeError(f"stock must be callable, got {type(stock).__name__}")
    _BOUND = (stock, _unpack_kinds(kinds))


def _is_index(value: Any) -> bool:
    return type(value) is int and -_INDEX_LIMIT < value < _INDEX_LIMIT


# What ``_plan`` finds vLLM's method would do (flags; ``STOCK`` alone: vLLM decides).
STOCK, NOTHING, ALLOCATE, CACHE = -1, 0, 1, 2


def _view(manager: Any, kinds: tuple[Any, ...]) -> SimpleNamespace | None:
    """What ``_plan`` reads of ``manager`` that is the same for every request
    (the compiled piece reads it once for a run of calls), or None where
    vLLM's method decides every call."""
    manager_type, coordinator_types, single_type, pool_type, _, spec_type, _ = kinds
    if type(manager) is not manager_type:
        return None
    coordinator = manager.coordinator
    if not any(type(coordinator) is kind for kind in coordinator_types):
        return None
    singles = coordinator.single_type_managers
    if type(singles) is not tuple or len(singles) != 1:
        return None
    single = singles[0]
    if type(single) is not single_type:
        return None
    req_to_blocks = single.req_to_blocks
    if not isinstance(req_to_blocks, dict):
        return None
    max_model_len, block_size = manager.max_model_len, single.block_size
    if not (_is_index(max_model_len) and _is_index(block_size)) or block_size <= 0:
        return None
    pool = single.block_pool
    if pool is not manager.block_pool:
        return None
    caching, cached, reprefillable = False, None, 0
    if single.enable_caching:
        hash_block_size = pool.hash_block_size
        if not _is_index(hash_block_size) or block_size != hash_block_size:
            return None
        spec = single.kv_cache_spec
        # The pinned KVCacheSpec.prefix_cacheable of vLLM's full-attention spec is True.
        if type(spec) is spec_type or spec.prefix_cacheable:
            reprefillable, cached = coordinator.num_reprefillable_tokens, single.num_cached_block
            if not (_is_index(reprefillable) and isinstance(cached, dict)):
                return None
            caching = True
    return SimpleNamespace(manager=manager, req_to_blocks=req_to_blocks,
                           partial_hits=single._partial_hit_reqs, pool=pool,
                           exact_pool=type(pool) is pool_type, max_model_len=max_model_len,
                           block_size=block_size, caching=caching, cached=cached,
                           reprefillable=reprefillable)


def _plan(view: SimpleNamespace, request: Any, num_new_tokens: int, reserved_blocks: int,
          num_lookahead_tokens: int, kinds: tuple[Any, ...]) -> tuple[int, int, int, int]:
    """(plan, num_tokens_need_slot, num_tokens_main_model, num_tokens_to_cache)
    of a decode call on ``view``'s manager."""
    request_type, running = kinds[4], kinds[6]
    stock = (STOCK, 0, 0, 0)
    if request.status is not running:
        return stock
    request_id = request.request_id
    blocks = dict.get(view.req_to_blocks, request_id)
    if type(blocks) is not list or request_id in view.partial_hits:
        return stock
    num_computed, block_size = request.num_computed_tokens, view.block_size
    if not _is_index(num_computed) or num_new_tokens <= 0 or num_computed < 0:
        return stock
    total_computed = min(num_computed, view.max_model_len)
    # The lookahead slots count towards the blocks needed, not the tokens to cache.
    need_slots = min(total_computed + num_new_tokens + num_lookahead_tokens, view.max_model_len)
    if need_slots < 0:
        return stock
    # vLLM's cdiv, for a count >= 0 and a block size > 0.
    blocks_needed = (need_slots + block_size - 1) // block_size - len(blocks)
    # BlockPool.get_num_free_blocks (pinned) returns this field.
    free = (view.pool.free_block_queue.num_free_blocks if view.exact_pool
            else view.pool.get_num_free_blocks())
    if not _is_index(free):
        return stock
    plan = ALLOCATE if blocks_needed > 0 else NOTHING
    if max(blocks_needed, 0) + reserved_blocks > free:
        return stock  # vLLM returns None
    to_cache = 0
    if view.caching:
        # Request.num_tokens (pinned) is the length of this list.
        num_tokens = (len(request._all_token_ids) if type(request) is request_type
                      else request.num_tokens)
        num_cached = dict.get(view.cached, request_id, 0)
        if not (_is_index(num_tokens) and _is_index(num_cached)):
            return stock
        cache_up_to = min(total_computed + num_new_tokens, num_tokens)
        cacheable = max(0, cache_up_to - view.reprefillable)
        # vLLM 0.32.0's count of full blocks; 0.33.0's is never larger.
        if num_cached < cacheable // block_size:
            plan |= CACHE
            to_cache = cache_up_to
    return plan, need_slots, total_computed + num_new_tokens, to_cache


def _plan_call(manager: Any, request: Any, num_new_tokens: Any, reserved_blocks: Any,
               num_lookahead_tokens: int, kinds: tuple[Any, ...]) -> tuple[int, int, int, int]:
    """``_plan`` for one call on ``manager``."""
    view = _view(manager, kinds)
    if view is None or not (_is_index(num_new_tokens) and _is_index(reserved_blocks)):
        return STOCK, 0, 0, 0
    return _plan(view, request, num_new_tokens, reserved_blocks, num_lookahead_tokens, kinds)


def _is_int_zero(value: Any) -> bool:
    return type(value) is int and value == 0


def _is_lookahead(value: Any) -> bool:
    """An exact int the compiled piece reads as a lookahead count (0 to 2**30 - 1)."""
    return _is_index(value) and value >= 0


def _count_noop(num_lookahead_tokens: int) -> None:
    _COUNTERS.values["noop_allocations"] += 1
    if num_lookahead_tokens:
        _COUNTERS.values["noop_lookahead_allocations"] += 1


def allocate_slots(self: Any, request: Any, num_new_tokens: int,
                   num_new_computed_tokens: int = 0, new_computed_blocks: Any = None,
                   num_lookahead_tokens: int = 0, num_external_computed_tokens: int = 0,
                   delay_cache_blocks: bool = False, num_encoder_tokens: int = 0,
                   full_sequence_must_fit: bool = False, reserved_blocks: int = 0,
                   has_scheduled_reqs: bool = True,
                   skip_zeroing_group_ids: tuple[int, ...] = ()) -> Any:
    """fastbatch's ``KVCacheManager.allocate_slots`` (vLLM's signature and defaults).

    ``self.empty_kv_cache_blocks`` where vLLM's method would return it and
    change nothing: every argument but ``num_new_tokens``,
    ``num_lookahead_tokens`` (an int >= 0) and ``reserved_blocks`` at its
    default (``has_scheduled_reqs`` and
    ``skip_zeroing_group_ids`` do not matter for a running request without new
    computed blocks) and ``allocate_slots_is_noop``; vLLM's method (``bind``)
    with the same arguments otherwise.
    """
    if _BOUND is None:
        raise RuntimeError("fastbatch's allocate_slots is not bound to vLLM's method "
                           "(fastbatch.patches.allocate_slots.bind() does it)")
    stock, kinds = _BOUND
    plan = need_slots = main_tokens = to_cache = STOCK
    if (new_computed_blocks is None and _is_int_zero(num_new_computed_tokens)
            and _is_lookahead(num_lookahead_tokens)
            and _is_int_zero(num_external_computed_tokens)
            and _is_int_zero(num_encoder_tokens) and delay_cache_blocks is False
            and full_sequence_must_fit is False):
        plan, need_slots, main_tokens, to_cache = _plan_call(
            self, request, num_new_tokens, reserved_blocks, num_lookahead_tokens, kinds)
    if plan == STOCK:
        _COUNTERS.values["stock_allocations"] += 1
        return stock(self, request, num_new_tokens, num_new_computed_tokens,
                     new_computed_blocks, num_lookahead_tokens, num_external_computed_tokens,
                     delay_cache_blocks, num_encoder_tokens, full_sequence_must_fit,
                     reserved_blocks, has_scheduled_reqs, skip_zeroing_group_ids)
    return _act(self, request, plan, num_lookahead_tokens, need_slots, main_tokens, to_cache,
                num_encoder_tokens)


def _act(manager: Any, request: Any, plan: int, num_lookahead_tokens: int, need_slots: int,
         main_tokens: int, to_cache: int, num_encoder_tokens: Any) -> Any:
    """What vLLM's method does for a call that ``_plan`` took (``plan`` is not
    ``STOCK``): nothing, or the coordinator's two calls; counted."""
    if plan == NOTHING:
        _count_noop(num_lookahead_tokens)
        return manager.empty_kv_cache_blocks
    _COUNTERS.values["direct_allocations"] += 1
    coordinator = manager.coordinator
    new_blocks = None
    if plan & ALLOCATE:
        new_blocks = coordinator.allocate_new_blocks(request.request_id, need_slots,
                                                     main_tokens, num_encoder_tokens)
    if plan & CACHE:
        coordinator.cache_blocks(request, to_cache)
    if new_blocks is None:
        return manager.empty_kv_cache_blocks
    return manager.create_kv_cache_blocks(new_blocks)


def _manager_view(manager: Any) -> SimpleNamespace | None:
    """``manager`` as the plan of its decode calls reads it
    (``_allocate_decode``), or None where vLLM's method decides every call (or
    nothing is bound).  The twin of the compiled piece's C ``manager_view``."""
    return None if _BOUND is None else _view(manager, _BOUND[1])


def _allocate_decode(view: SimpleNamespace, request: Any, num_new_tokens: int,
                     num_lookahead_tokens: int, act: bool) -> Any:
    """The scheduler's decode call ``manager.allocate_slots(request,
    num_new_tokens, num_lookahead_tokens=num_lookahead_tokens)`` on the
    manager of ``view`` (``_manager_view``), every other argument at its
    default (``num_lookahead_tokens``: the scheduler's, checked by the caller
    once, ``_is_lookahead``): None (nothing done) where vLLM's method is
    needed; else, with ``act``, what ``allocate_slots`` returns for it (and
    counts), without, True (nothing done: the call will not return None).
    The twin of the compiled piece's C function ``allocate_decode`` (for
    ``schedule_running``)."""
    if _BOUND is None:
        return None
    plan, need_slots, main_tokens, to_cache = _plan(
        view, request, num_new_tokens, 0, num_lookahead_tokens, _BOUND[1])
    if plan == STOCK:
        return None
    if not act:
        return True
    return _act(view.manager, request, plan, num_lookahead_tokens, need_slots, main_tokens,
                to_cache, 0)


def allocate_slots_is_noop(manager: Any, request: Any, num_new_tokens: Any,
                           reserved_blocks: Any, kinds: tuple[Any, ...],
                           num_lookahead_tokens: Any = 0) -> bool:
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
    kinds = _unpack_kinds(kinds)
    noop = (_is_lookahead(num_lookahead_tokens)
            and _plan_call(manager, request, num_new_tokens, reserved_blocks,
                           num_lookahead_tokens, kinds)[0] == NOTHING)
    if noop:
        _count_noop(num_lookahead_tokens)
    else:
        _COUNTERS.values["stock_allocations"] += 1
    return noop
