"""Patch: ``vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slots``.

What is replaced: the KV-cache manager's slot allocation, which the scheduler
calls once per running request per step (``Scheduler.schedule``), and once
per newly admitted request.  The replacement is one compiled function
(``fastbatch._kernels.allocate_slots.allocate_slots``, bound on the class as
the method itself, vLLM's signature and defaults): it answers at once, with
vLLM's own ``empty_kv_cache_blocks``, when it finds that vLLM's method would
return exactly that and change nothing (the decision of
``fastbatch.allocate_slots_is_noop``): a RUNNING request, one full-attention
KV group, every other argument at its default, no new block needed, nothing
new to cache.  That is the plain decode step, 15 steps out of 16 with blocks
of 16 tokens.  Every other call runs vLLM's method, unchanged, with the same
arguments.

Why: in a decode step stock walks the manager, the coordinator and the
single-type manager (remove skipped blocks, count blocks to allocate,
allocate none, cache none, build the result) to conclude that nothing
changes; at 1024 running requests that is the largest single cost of the
scheduler step (cProfile: 3.3 s of 6.2 s in ``schedule``).

The scheduler is the same code under Model Runner V1 and V2 (it runs in
EngineCore, not in the worker), so this piece acts under both runners.

When it can go: if vLLM gives ``allocate_slots`` its own fast exit for a
request that needs no new block and fills no block.

Safety: see ``fastbatch.patches._patch``.  The guard pins the target and
every vLLM function on the path the fast answer stands in for (the
coordinator's and the single-type manager's allocation, block counting,
skipped-block removal and caching, ``replay_boundaries``, the block pool's
free count, ``Request.num_tokens`` and the full-attention spec's
``prefix_cacheable``, whose results the compiled call reads straight from
the fields they return); the activation check also refuses when the coordinator or the
full-attention manager class overrides any of those, and runs stock and
fastbatch side by side on two small real KV-cache managers (prefix caching
on and off, across block boundaries).
"""

from __future__ import annotations

from typing import Any

import fastbatch
from fastbatch.patches._patch import Patch

MODULE = "vllm.v1.core.kv_cache_manager"
COORDINATOR = "vllm.v1.core.kv_cache_coordinator"
SINGLE_TYPE = "vllm.v1.core.single_type_kv_cache_manager"

VERIFIED_FINGERPRINTS = {
    "76ddab98f3e29547479311ce4bb74b8446da89e24851720759bd88522c7b316d": "vLLM 0.32.0-0.33.0",
}
COMPANION_FINGERPRINTS = {
    f"{MODULE}:KVCacheManager.create_kv_cache_blocks": {
        "6010d9d6770a647c2fb353973188ca411bcdfaf54013e46d2512e1ce12592320": "vLLM 0.32.0-0.33.0"},
    f"{COORDINATOR}:KVCacheCoordinator.get_num_blocks_to_allocate": {
        "0778a9f2f91c10c0d19901f0496877cbdca9d30b5e16cc35ecde3baea46c4d8b": "vLLM 0.32.0-0.33.0"},
    f"{COORDINATOR}:KVCacheCoordinator.allocate_new_computed_blocks": {
        "f0c870b3548566ceb65d6ff10a3a81870851c0bfb5ffada7ac2a94b3ea593cf9": "vLLM 0.32.0-0.33.0"},
    f"{COORDINATOR}:KVCacheCoordinator.allocate_new_blocks": {
        "95397e390a22b80afa23371df6e7d96c8afd9bb6834ca028bc74e068e52c1e22": "vLLM 0.32.0-0.33.0"},
    f"{COORDINATOR}:KVCacheCoordinator.get_num_cacheable_tokens": {
        "07c1ee429b549adab84659e27b61531c1aa4c55e96cf28b0498ebbca89143549": "vLLM 0.32.0-0.33.0"},
    f"{COORDINATOR}:KVCacheCoordinator.cache_blocks": {
        "8b63eea0bf300913bb82c6f552407da5cc85de08a70b3c2f9566a627e674a282":
            "vLLM 0.32.0: replay boundaries from eagle_group_ids (pure, read only)",
        "2bb7b1fbf2d5d677df1575911e4ddd1bc5f474764bb7517eaab886554f05279d":
            "vLLM 0.33.0: replay boundaries from drop_eagle_group_ids"},
    f"{COORDINATOR}:KVCacheCoordinator.remove_skipped_blocks": {
        "fb2ebfe747af6b41e9ba28ebe18410a1e99b588a8a869091bd133ca9d5d4d173": "vLLM 0.32.0-0.33.0"},
    f"{COORDINATOR}:replay_boundaries": {
        "fdbb12b84dda0ac5e4b121d10b343c55f4f1d260e7d912af9d746024068a0a96": "vLLM 0.32.0-0.33.0"},
    f"{SINGLE_TYPE}:SingleTypeKVCacheManager.get_num_blocks_to_allocate": {
        "ff0c4a69190434722d66172b9168150d008327afedb8f33531bd35050d72c02f": "vLLM 0.32.0-0.33.0"},
    f"{SINGLE_TYPE}:SingleTypeKVCacheManager.allocate_new_blocks": {
        "cf7e83edf6a526ee24540fb304b7e042d3cdbeddffb81e6c8b4523b2291b0ae3": "vLLM 0.32.0-0.33.0"},
    f"{SINGLE_TYPE}:SingleTypeKVCacheManager.cache_blocks": {
        "5f63dc78fb857aff332222349da5d5ce04683bd606c4b00743f935719a3631c8":
            "vLLM 0.32.0: full blocks = num_tokens // block_size",
        "a20ae08d12b7b2ddcf0caf0b46df858b7bb120c24f57630a019114b15fd67c08":
            "vLLM 0.33.0: full blocks limited to the hashed tokens"},
    f"{SINGLE_TYPE}:SingleTypeKVCacheManager.remove_skipped_blocks": {
        "3fb797e9eed447b879583337f520907c92728ccee9841d40a976dd614b9d8b9b": "vLLM 0.32.0-0.33.0"},
    f"{SINGLE_TYPE}:SingleTypeKVCacheManager.get_num_skipped_tokens": {
        "45aadbc037d572ebc622bb5341504a7852ab6a688fdf03936df6162d4b4f3852": "vLLM 0.32.0-0.33.0"},
    f"{SINGLE_TYPE}:FullAttentionManager.cache_blocks": {
        "eccffa40955d947e3cf48b0ffce6d4d91a2f18bbbba3f8aa3c67b8a1fe22bb2e": "vLLM 0.32.0-0.33.0"},
    "vllm.v1.core.block_pool:BlockPool.get_num_free_blocks": {
        "524e12794b92106b07b80456eef44ede75be423234913cd3eb6ff91152b614d3": "vLLM 0.32.0-0.33.0"},
    # Properties: their getters (the compiled call reads what they return).
    "vllm.v1.request:Request.num_tokens.fget": {
        "d70392fb2938c5c907af6d7176b8ccb116027a931998fea6f5a0ebff08f41a63": "vLLM 0.32.0-0.33.0"},
    "vllm.v1.kv_cache_interface:FullAttentionSpec.prefix_cacheable.fget": {
        "c00daac6f107eb5f6024f5d915afe985a58e00aad3b1ee6ba3e6bed17f8a55fb": "vLLM 0.32.0-0.33.0"},
}

# The methods the fast answer stands in for, which the coordinator and the
# full-attention manager classes must inherit, not override.
_COORDINATOR_METHODS = ("get_num_blocks_to_allocate", "allocate_new_computed_blocks",
                        "allocate_new_blocks", "get_num_cacheable_tokens", "cache_blocks",
                        "remove_skipped_blocks")
_SINGLE_TYPE_METHODS = ("get_num_blocks_to_allocate", "allocate_new_blocks",
                        "remove_skipped_blocks", "get_num_skipped_tokens")

# The piece in use: the compiled one, or its twin where it cannot be imported
# (then the plugin leaves vLLM stock anyway).
if fastbatch.COMPILED:
    from fastbatch._kernels import allocate_slots as _piece
else:
    from fastbatch._reference import allocate_slots as _piece

# fastbatch's drop-in for ``KVCacheManager.allocate_slots``: the compiled
# function itself, bound on vLLM's class (one compiled call per call), with
# vLLM's signature and defaults.  ``bind()`` gives it vLLM's method and classes.
allocate_slots = _piece.allocate_slots


def kinds() -> tuple[Any, ...]:
    """vLLM's classes on the fast path and ``RequestStatus.RUNNING``, as the
    piece's ``kinds``: (KVCacheManager, (coordinator types), FullAttentionManager,
    BlockPool, Request, FullAttentionSpec, RUNNING)."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_coordinator import (
        KVCacheCoordinatorNoPrefixCache,
        UnitaryKVCacheCoordinator,
    )
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.request import Request, RequestStatus

    return (KVCacheManager, (UnitaryKVCacheCoordinator, KVCacheCoordinatorNoPrefixCache),
            FullAttentionManager, BlockPool, Request, FullAttentionSpec, RequestStatus.RUNNING)


def bind(stock: Any = None) -> None:
    """Bind ``allocate_slots`` to ``stock`` (by default vLLM's own method: the
    original while the patch is applied, else the class's) and vLLM's classes."""
    if stock is None:
        from vllm.v1.core.kv_cache_manager import KVCacheManager

        stock = PATCH.original() or KVCacheManager.allocate_slots
    _piece.bind(stock, kinds())


def overridden_methods() -> list[str]:
    """The methods on the fast answer's path that the plain coordinator or
    full-attention manager classes override (must be none)."""
    from vllm.v1.core import kv_cache_coordinator as coordinators
    from vllm.v1.core import single_type_kv_cache_manager as singles

    found = []
    for cls in (coordinators.UnitaryKVCacheCoordinator,
                coordinators.KVCacheCoordinatorNoPrefixCache):
        found += [f"{cls.__name__}.{name}" for name in _COORDINATOR_METHODS
                  if getattr(cls, name) is not getattr(coordinators.KVCacheCoordinator, name)]
    found += [f"FullAttentionManager.{name}" for name in _SINGLE_TYPE_METHODS
              if getattr(singles.FullAttentionManager, name)
              is not getattr(singles.SingleTypeKVCacheManager, name)]
    return found


def kv_manager_state(manager: Any) -> Any:
    """A KV-cache manager's state as plain data: block tables, cached counts,
    free queue order, ref counts and hashes."""
    pool = manager.block_pool
    return (
        [({rid: [block.block_id for block in blocks]
           for rid, blocks in single.req_to_blocks.items()},
          dict(single.num_cached_block), sorted(single._partial_hit_reqs))
         for single in manager.coordinator.single_type_managers],
        [block.block_id for block in pool.free_block_queue.get_all_free_blocks()],
        [(block.block_id, block.ref_cnt, block.block_hash) for block in pool.blocks],
    )


def _small_manager(enable_caching: bool) -> Any:
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    config = KVCacheConfig(num_blocks=12, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=4, num_kv_heads=1,
                                                      head_size=1, dtype=torch.float32))])
    return KVCacheManager(config, max_model_len=64, scheduler_block_size=4,
                          hash_block_size=4, enable_caching=enable_caching)


def _small_request(request_id: str) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(request_id=request_id, prompt_token_ids=[5, 6, 7, 8, 9, 10],
                   sampling_params=SamplingParams(max_tokens=16), pooling_params=None,
                   arrival_time=0.0, block_hasher=get_request_block_hasher(4, sha256))


def activation_check(method: Any, replacement: Any) -> str | None:
    """Why fastbatch must stay off, or None: an override on the path, or a
    difference between stock and fastbatch on two small real KV-cache managers
    (a prefill, then decode steps across block boundaries, a step with more
    blocks reserved than free, prefix caching on and off)."""
    from vllm.v1.request import RequestStatus

    bind(method)
    overridden = overridden_methods()
    if overridden:
        return f"{', '.join(overridden)} override(s) the base method"
    for enable_caching in (True, False):
        managers = (_small_manager(enable_caching), _small_manager(enable_caching))
        requests = (_small_request("a"), _small_request("a"))
        for step in range(12):
            results = []
            sides = zip(managers, requests, (method, replacement), strict=True)
            for manager, request, allocate in sides:
                num_new = request.num_tokens - request.num_computed_tokens
                reserved = 100 if step == 7 else 0
                blocks = allocate(manager, request, num_new, reserved_blocks=reserved)
                results.append(None if blocks is None else
                               (blocks is manager.empty_kv_cache_blocks, blocks.get_block_ids()))
                if blocks is not None:
                    request.status = RequestStatus.RUNNING
                    request.num_computed_tokens += num_new
                    request.append_output_token_ids(20 + step)
            if results[0] != results[1]:
                return f"step {step}: fastbatch returned {results[1]}, vLLM {results[0]}"
            stock_state, fast_state = (kv_manager_state(manager) for manager in managers)
            if stock_state != fast_state:
                return f"step {step}: KV-cache state {fast_state} != vLLM's {stock_state}"
    return None


PATCH = Patch(f"{MODULE}:KVCacheManager.allocate_slots", allocate_slots,
              fingerprints=VERIFIED_FINGERPRINTS, activation_check=activation_check,
              companions=COMPANION_FINGERPRINTS)
