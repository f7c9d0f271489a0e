"""Patch: ``vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slots``.

What is replaced: the KV-cache manager's slot allocation, which the scheduler
calls once per running request per step (``Scheduler.schedule``), and once per
newly admitted request. One compiled method answers or plans a RUNNING
request's decode call; every other call runs vLLM's method. vLLM 0.32.0 to
0.34.0.

Guard: the fingerprints of the method and of every function on the path the
fast answer stands in for (the companions); the activation check runs two
small real KV-cache managers and must see the compiled calls answer and plan;
the shadow checks each answered or planned call.

When it can go: if vLLM gives ``allocate_slots`` its own fast path for a
running request's decode call.

Upstream: vllm-project/vllm#29206 (an early return in ``allocate_slots``,
closed unmerged).

Story and numbers: ``docs/pieces/allocate_slots.md``.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from fastbatch import registry
from fastbatch.patches._patch import Patch, Shadow
from fastbatch.patches._stand_ins import hashed_request, kv_manager_state, small_manager

GROUP = "scheduler"  # fastbatch.registry.GROUPS

MODULE = "vllm.v1.core.kv_cache_manager"
COORDINATOR = "vllm.v1.core.kv_cache_coordinator"
SINGLE_TYPE = "vllm.v1.core.single_type_kv_cache_manager"

# What the compiled call reads of vLLM's objects, it reads where a pinned
# function below reads it, the same way: ``req_to_blocks[id]``'s length
# (``get_num_blocks_to_allocate``), ``_partial_hit_reqs`` (``_has_partial_local_hit``),
# ``num_cached_block.get(id, 0)``, ``block_pool.hash_block_size`` and
# ``kv_cache_spec.prefix_cacheable`` (``cache_blocks``), ``enable_caching`` and
# ``num_reprefillable_tokens`` (the coordinator's ``cache_blocks`` and
# ``get_num_cacheable_tokens``), ``free_block_queue.num_free_blocks``
# (``BlockPool.get_num_free_blocks``), ``len(_all_token_ids)`` (``Request.num_tokens``).
# It reads no block, block hash, free-queue link or prefix-cache map, and writes
# nothing: the planned calls are vLLM's coordinator's own.  So what vLLM 0.34.0
# changed there (the map's block ids and ``_dup_ids``, ``KVCacheBlock.block_hash``
# as a field, its weak ``pool``, ``untracked_list``, ``TokenBuffer``) is not on
# what the fast path stands in for; every function below kept its fingerprint.
VERIFIED_FINGERPRINTS = {
    "76ddab98f3e29547479311ce4bb74b8446da89e24851720759bd88522c7b316d": "vLLM 0.32.0-0.34.0",
}
COMPANION_FINGERPRINTS = {
    f"{MODULE}:KVCacheManager.create_kv_cache_blocks": {
        "6010d9d6770a647c2fb353973188ca411bcdfaf54013e46d2512e1ce12592320": "vLLM 0.32.0-0.34.0"},
    f"{COORDINATOR}:KVCacheCoordinator.get_num_blocks_to_allocate": {
        "0778a9f2f91c10c0d19901f0496877cbdca9d30b5e16cc35ecde3baea46c4d8b": "vLLM 0.32.0-0.34.0"},
    f"{COORDINATOR}:KVCacheCoordinator.allocate_new_computed_blocks": {
        "f0c870b3548566ceb65d6ff10a3a81870851c0bfb5ffada7ac2a94b3ea593cf9": "vLLM 0.32.0-0.34.0"},
    f"{COORDINATOR}:KVCacheCoordinator.allocate_new_blocks": {
        "95397e390a22b80afa23371df6e7d96c8afd9bb6834ca028bc74e068e52c1e22": "vLLM 0.32.0-0.34.0"},
    f"{COORDINATOR}:KVCacheCoordinator.get_num_cacheable_tokens": {
        "07c1ee429b549adab84659e27b61531c1aa4c55e96cf28b0498ebbca89143549": "vLLM 0.32.0-0.34.0"},
    f"{COORDINATOR}:KVCacheCoordinator.cache_blocks": {
        "8b63eea0bf300913bb82c6f552407da5cc85de08a70b3c2f9566a627e674a282":
            "vLLM 0.32.0: replay boundaries from eagle_group_ids (pure, read only)",
        "2bb7b1fbf2d5d677df1575911e4ddd1bc5f474764bb7517eaab886554f05279d":
            "vLLM 0.33.0-0.34.0: replay boundaries from drop_eagle_group_ids"},
    f"{COORDINATOR}:KVCacheCoordinator.remove_skipped_blocks": {
        "fb2ebfe747af6b41e9ba28ebe18410a1e99b588a8a869091bd133ca9d5d4d173": "vLLM 0.32.0-0.34.0"},
    f"{COORDINATOR}:replay_boundaries": {
        "fdbb12b84dda0ac5e4b121d10b343c55f4f1d260e7d912af9d746024068a0a96": "vLLM 0.32.0-0.34.0"},
    f"{SINGLE_TYPE}:SingleTypeKVCacheManager.get_num_blocks_to_allocate": {
        "ff0c4a69190434722d66172b9168150d008327afedb8f33531bd35050d72c02f": "vLLM 0.32.0-0.34.0"},
    # The block count of a request without a cached-block entry (no prefix
    # cache) reads these two on its (empty) new computed blocks.
    f"{SINGLE_TYPE}:SingleTypeKVCacheManager._has_partial_local_hit": {
        "ab42d67829c56771857e3bffcf6d6e73e6e14eb4fbc7c1ead833e241519b4cfa": "vLLM 0.32.0-0.34.0"},
    f"{SINGLE_TYPE}:SingleTypeKVCacheManager._get_num_evictable_blocks": {
        "ccc150d0bf1b51f431145fc4e5362da9c25fa66f92ffe43c71c5e1a1f2f01e18": "vLLM 0.32.0-0.34.0"},
    f"{SINGLE_TYPE}:SingleTypeKVCacheManager.allocate_new_blocks": {
        "cf7e83edf6a526ee24540fb304b7e042d3cdbeddffb81e6c8b4523b2291b0ae3": "vLLM 0.32.0-0.34.0"},
    f"{SINGLE_TYPE}:SingleTypeKVCacheManager.cache_blocks": {
        "5f63dc78fb857aff332222349da5d5ce04683bd606c4b00743f935719a3631c8":
            "vLLM 0.32.0: full blocks = num_tokens // block_size",
        "a20ae08d12b7b2ddcf0caf0b46df858b7bb120c24f57630a019114b15fd67c08":
            "vLLM 0.33.0-0.34.0: full blocks limited to the hashed tokens"},
    f"{SINGLE_TYPE}:SingleTypeKVCacheManager.remove_skipped_blocks": {
        "3fb797e9eed447b879583337f520907c92728ccee9841d40a976dd614b9d8b9b": "vLLM 0.32.0-0.34.0"},
    f"{SINGLE_TYPE}:SingleTypeKVCacheManager.get_num_skipped_tokens": {
        "45aadbc037d572ebc622bb5341504a7852ab6a688fdf03936df6162d4b4f3852": "vLLM 0.32.0-0.34.0"},
    f"{SINGLE_TYPE}:FullAttentionManager.cache_blocks": {
        "eccffa40955d947e3cf48b0ffce6d4d91a2f18bbbba3f8aa3c67b8a1fe22bb2e": "vLLM 0.32.0-0.34.0"},
    "vllm.v1.core.block_pool:BlockPool.get_num_free_blocks": {
        "524e12794b92106b07b80456eef44ede75be423234913cd3eb6ff91152b614d3": "vLLM 0.32.0-0.34.0"},
    # Properties: their getters (the compiled call reads what they return).
    "vllm.v1.request:Request.num_tokens.fget": {
        "d70392fb2938c5c907af6d7176b8ccb116027a931998fea6f5a0ebff08f41a63": "vLLM 0.32.0-0.34.0"},
    "vllm.v1.kv_cache_interface:FullAttentionSpec.prefix_cacheable.fget": {
        "c00daac6f107eb5f6024f5d915afe985a58e00aad3b1ee6ba3e6bed17f8a55fb": "vLLM 0.32.0-0.34.0"},
}

# The methods the fast answer stands in for, which the coordinator and the
# full-attention manager classes must inherit, not override.
_COORDINATOR_METHODS = ("get_num_blocks_to_allocate", "allocate_new_computed_blocks",
                        "allocate_new_blocks", "get_num_cacheable_tokens", "cache_blocks",
                        "remove_skipped_blocks")
_SINGLE_TYPE_METHODS = ("get_num_blocks_to_allocate", "allocate_new_blocks",
                        "remove_skipped_blocks", "get_num_skipped_tokens",
                        "_has_partial_local_hit", "_get_num_evictable_blocks")

# The piece in use: the compiled one, or its twin (then the plugin leaves
# vLLM stock anyway).
_piece = registry.implementation("allocate_slots")

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
    # As stored on the class (a classmethod is bound anew by every getattr).
    found += [f"FullAttentionManager.{name}" for name in _SINGLE_TYPE_METHODS
              if inspect.getattr_static(singles.FullAttentionManager, name)
              is not inspect.getattr_static(singles.SingleTypeKVCacheManager, name)]
    return found


def _side_by_side(method: Any, replacement: Any, enable_caching: bool,
                  lookahead: int) -> str | None:
    """Stock and fastbatch on two small real KV-cache managers, one request
    each, twelve steps: a prefill, then decode steps across block boundaries
    (with ``lookahead``: spec decode steps, 0 to 2 drafts verified, some
    rejected, ``lookahead`` slots past them), a step with more blocks
    reserved than free.  Why they differ, or None."""
    from vllm.v1.request import RequestStatus

    managers = (small_manager(enable_caching), small_manager(enable_caching))
    requests = (hashed_request("a"), hashed_request("a"))
    for step in range(12):
        results = []
        sides = zip(managers, requests, (method, replacement), strict=True)
        num_drafts = step % 3 if lookahead else 0
        accepted = (step // 3) % (num_drafts + 1)
        for manager, request, allocate in sides:
            num_new = request.num_tokens - request.num_computed_tokens + num_drafts
            reserved = 100 if step == 7 else 0
            blocks = allocate(manager, request, num_new, reserved_blocks=reserved,
                              num_lookahead_tokens=lookahead)
            results.append(None if blocks is None else
                           (blocks is manager.empty_kv_cache_blocks, blocks.get_block_ids()))
            if blocks is not None:
                # The drafts verified: ``accepted`` of them and one more token
                # sampled, the rejected ones taken back from the computed count.
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens += num_new - (num_drafts - accepted)
                request.append_output_token_ids([20 + step + i for i in range(accepted + 1)])
        if results[0] != results[1]:
            return (f"step {step} (lookahead {lookahead}): fastbatch returned "
                    f"{results[1]}, vLLM {results[0]}")
        stock_state, fast_state = (kv_manager_state(manager) for manager in managers)
        if stock_state != fast_state:
            return (f"step {step} (lookahead {lookahead}): KV-cache state {fast_state} "
                    f"!= vLLM's {stock_state}")
    return None


def activation_check(method: Any, replacement: Any) -> str | None:
    """Why fastbatch must stay off, or None: an override on the path, a
    difference between stock and fastbatch on two small real KV-cache managers
    (vLLM's ``KVCacheManager`` and ``Request``: a prefill, then decode steps
    across block boundaries, plain and with spec decoding's drafts and
    lookahead slots, a step with more blocks reserved than free, prefix
    caching on and off), or a fast path that took none of those calls (the
    piece's counters: answered plain and lookahead calls, planned ones)."""
    bind(method)
    overridden = overridden_methods()
    if overridden:
        return f"{', '.join(overridden)} override(s) the base method"
    before = _piece.stats()
    for enable_caching in (True, False):
        for lookahead in (0, 2):
            problem = _side_by_side(method, replacement, enable_caching, lookahead)
            if problem is not None:
                return problem
    return _fast_path_unused(before, _piece.stats())


# What the check's steps must have taken on the fast path: answered (plain and
# with lookahead slots) and planned (new blocks, a block to cache).
_CHECKED_PATHS = {"noop_allocations": "answered a decode call itself",
                  "noop_lookahead_allocations": "answered a spec decode call itself",
                  "direct_allocations": "planned an allocation or caching itself"}


def _fast_path_unused(before: dict[str, int], after: dict[str, int]) -> str | None:
    """Why the check did not prove the fast path (a counter of the piece in
    use did not move while vLLM's results were matched), or None."""
    unused = [what for counter, what in _CHECKED_PATHS.items()
              if after[counter] == before[counter]]
    if not unused:
        return None
    return (f"fastbatch's allocate_slots never {' nor '.join(unused)} in the check "
            f"({after['stock_allocations'] - before['stock_allocations']} calls handed to "
            f"vLLM's method): the fast path does not take this vLLM's requests")


# The shadow check (FASTBATCH_VERIFY) ---------------------------------------

_ARGUMENTS = ("num_new_tokens", "num_new_computed_tokens", "new_computed_blocks",
              "num_lookahead_tokens", "num_external_computed_tokens", "delay_cache_blocks",
              "num_encoder_tokens", "full_sequence_must_fit", "reserved_blocks",
              "has_scheduled_reqs", "skip_zeroing_group_ids")


def _counted(counter: str) -> int:
    """A counter of the piece in use (compiled, or its twin)."""
    return _piece.stats()[counter]


def _state(manager: Any, request_id: str) -> tuple[Any, ...]:
    """What ``allocate_slots`` can change for ``request_id``, as plain data:
    per KV-cache group the request's block ids, cached block count and
    pending partial hit; the free block count."""
    return (tuple(
        (None if (blocks := dict.get(single.req_to_blocks, request_id)) is None
         else [block.block_id for block in blocks],
         dict.get(single.num_cached_block, request_id), request_id in single._partial_hit_reqs)
        for single in manager.coordinator.single_type_managers),
        manager.block_pool.get_num_free_blocks())


def _snapshot(self: Any, request: Any, *args: Any, **kwargs: Any) -> dict[str, Any] | None:
    """The live manager and request (kept, not copied: see ``_run``), the
    call's arguments (by name), the request's KV-cache state and how many
    calls the piece has handed to vLLM's method so far; None (not checked)
    for more arguments than vLLM's method takes (it raises)."""
    if len(args) > len(_ARGUMENTS):
        return None
    arguments = dict(zip(_ARGUMENTS[:len(args)], args, strict=True))
    arguments.update(kwargs)
    return {"manager": self, "request": request, "arguments": arguments,
            "before": _state(self, request.request_id),
            "stock_calls": _counted("stock_allocations"),
            "direct_calls": _counted("direct_allocations")}


def _check(inputs: dict[str, Any], result: Any, *args: Any, **kwargs: Any) -> bool:
    """Only the calls that fastbatch answered itself (it did not call vLLM's method)."""
    return _counted("stock_allocations") == inputs["stock_calls"]


def _by_count(state: Any) -> Any:
    """A ``_state`` with each block list as its length and without the free
    count (an outcome by counts compares the free count's change)."""
    groups, _ = state
    return tuple((None if blocks is None else len(blocks), cached, partial)
                 for blocks, cached, partial in groups)


class _Answer:
    """An outcome: what the call returned (``"empty_kv_cache_blocks"``,
    None, or the new blocks' ids) and what it changed (plain data); the
    returned object itself rides along for ``_restore`` but is neither
    compared nor pickled.  ``by_count``: the new blocks as counts per group,
    the request's blocks as counts and the free blocks as a change, which is
    what a planned call and vLLM's method on a rebuilt manager can share
    (their block ids differ)."""

    def __init__(self, manager: Any, result: Any, before: Any, after: Any,
                 by_count: bool = False) -> None:
        self.returned = ("empty_kv_cache_blocks" if result is manager.empty_kv_cache_blocks
                         else None if result is None else result.get_block_ids())
        if by_count:
            if isinstance(self.returned, tuple):
                self.returned = tuple(len(group) for group in self.returned)
            before, after = (_by_count(before), after[1] - before[1]), (_by_count(after), 0)
        self.changed = None if before == after else (before, after)
        self.result = result

    def key(self) -> tuple[Any, Any]:
        return self.returned, self.changed

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Answer) and self.key() == other.key()

    def __getstate__(self) -> dict[str, Any]:
        return {"returned": self.returned, "changed": self.changed, "result": None}

    def __repr__(self) -> str:
        changed = ("changed nothing" if self.changed is None else
                   f"changed (request's blocks, cached blocks, partial hit per group; free "
                   f"blocks) from {self.changed[0]} to {self.changed[1]}")
        return f"returned {self.returned!r} and {changed}"


def _outcome(inputs: dict[str, Any], result: Any, self: Any, request: Any,
             *args: Any, **kwargs: Any) -> _Answer:
    after = _state(self, request.request_id)
    if _counted("direct_allocations") != inputs["direct_calls"]:
        # A planned call: what vLLM's method is to run on (``_run``), a
        # manager and request rebuilt as they were before it (the call
        # changed neither the request nor the manager's sizes).
        inputs["planned"] = _for_reproducer(inputs)
        return _Answer(self, result, inputs["before"], after, by_count=True)
    return _Answer(self, result, inputs["before"], after)


def _run(function: Any, inputs: dict[str, Any]) -> _Answer:
    """``function`` on the LIVE manager and request (``_snapshot``'s), right
    after fastbatch's "nothing to allocate, nothing changes": vLLM's method,
    run now, sees the state it would have seen, and where fastbatch was right
    it changes nothing; where it was wrong, what vLLM's method did is its
    result, in place.  After a planned call (new blocks or caching asked of
    vLLM's coordinator) it runs on a small manager and request rebuilt as
    they were before the call (``_rebuild``), compared by counts.  On a
    reproducer's inputs (``_for_reproducer``) it runs on a rebuild of them."""
    by_count = "planned" in inputs
    if by_count:
        manager, request, arguments = _rebuild(inputs["planned"], small=True)
    elif "manager" in inputs:
        manager, request, arguments = inputs["manager"], inputs["request"], inputs["arguments"]
    else:
        manager, request, arguments = _rebuild(inputs)
    before = _state(manager, request.request_id)
    result = function(manager, request, **arguments)
    return _Answer(manager, result, before, _state(manager, request.request_id), by_count)


def _compare(ours: _Answer, stock: _Answer) -> str | None:
    if ours == stock:
        return None
    return f"fastbatch {ours!r}; vLLM {stock!r}"


def _restore(inputs: dict[str, Any], stock: _Answer, result: Any, *args: Any,
             **kwargs: Any) -> Any:
    """vLLM's method already ran on the live state (``_run``): what it
    changed stands; the call returns what it returned.  After a planned call
    vLLM's method ran on a rebuild: the blocks that vLLM's coordinator
    allocated and cached for fastbatch's plan stand (nothing of the live
    state can be rolled back), the call returns them, and the piece runs
    vLLM's method from the next call on."""
    return result if "planned" in inputs else stock.result


def _for_reproducer(inputs: dict[str, Any]) -> dict[str, Any]:
    """What a one-group manager and the request can be rebuilt from (see
    ``_rebuild``): the KV-cache config and the manager's sizes, the request's
    tokens, counters and status, its blocks, cached blocks and the free block
    count as they were before the call, and the call's arguments
    (``new_computed_blocks`` as block ids; ``num_lookahead_tokens`` among
    them).  ``use_eagle`` too: with EAGLE's block drop, caching keeps other
    blocks."""
    manager, request = inputs["manager"], inputs["request"]
    coordinator = manager.coordinator
    groups, free = inputs["before"]
    arguments = dict(inputs["arguments"])
    if arguments.get("new_computed_blocks") is not None:
        arguments["new_computed_blocks"] = arguments["new_computed_blocks"].get_block_ids()
    return {
        "kv_cache_config": manager.kv_cache_config, "max_model_len": manager.max_model_len,
        "scheduler_block_size": coordinator.scheduler_block_size,
        "hash_block_size": manager.block_pool.hash_block_size,
        "enable_caching": manager.enable_caching,
        "use_eagle": manager.use_eagle,
        "num_reprefillable_tokens": coordinator.num_reprefillable_tokens,
        "watermark_blocks": manager.watermark_blocks,
        "request": {
            "request_id": request.request_id,
            "prompt_token_ids": list(request.prompt_token_ids or ()),
            "output_token_ids": list(request.output_token_ids),
            "num_block_hashes": len(request.block_hashes),
            "num_computed_tokens": request.num_computed_tokens,
            "num_in_flight_tokens": request.num_in_flight_tokens,
            "status": request.status.name,
        },
        "groups": groups, "free_blocks": free, "arguments": arguments,
    }


def _rebuild(inputs: dict[str, Any], small: bool = False) -> tuple[Any, Any, dict[str, Any]]:
    """A fresh manager of the reproducer's config and a request in the
    recorded state: its blocks (fresh ones, as many as it held), cached
    block count, counters and status, and other blocks taken so that the
    free count is the recorded one; and the call's arguments.  Block ids and
    hashes are the rebuild's own; vLLM's decision does not depend on them.
    ``small``: a pool of only the blocks held and at most ``reserved_blocks +
    num_new_tokens + num_lookahead_tokens + 2`` free ones (more than the call
    can need, and cheap to build where the engine's pool is large); compare
    the free count's change, not its value."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request, RequestStatus

    reprefillable = inputs["num_reprefillable_tokens"]
    config, free_blocks = inputs["kv_cache_config"], inputs["free_blocks"]
    if small:
        arguments = inputs["arguments"]
        free_blocks = min(free_blocks, arguments.get("reserved_blocks", 0)
                          + arguments["num_new_tokens"]
                          + arguments.get("num_lookahead_tokens", 0) + 2)
        held = sum(len(blocks) for blocks, _, _ in inputs["groups"] if blocks)
        config = dataclasses.replace(config, num_blocks=1 + held + free_blocks)
    manager = KVCacheManager(config, max_model_len=inputs["max_model_len"],
                             scheduler_block_size=inputs["scheduler_block_size"],
                             hash_block_size=inputs["hash_block_size"],
                             enable_caching=inputs["enable_caching"],
                             use_eagle=inputs.get("use_eagle", False),
                             num_prefill_lookahead=reprefillable + 1 if reprefillable else 0)
    manager.watermark_blocks = inputs["watermark_blocks"]
    recorded = inputs["request"]
    init_none_hash(sha256)
    request = Request(request_id=recorded["request_id"],
                      prompt_token_ids=list(recorded["prompt_token_ids"]),
                      sampling_params=SamplingParams(max_tokens=inputs["max_model_len"]),
                      pooling_params=None, arrival_time=0.0,
                      block_hasher=get_request_block_hasher(inputs["hash_block_size"], sha256))
    request.append_output_token_ids(list(recorded["output_token_ids"]))
    del request.block_hashes[recorded["num_block_hashes"]:]
    request.num_computed_tokens = recorded["num_computed_tokens"]
    request.num_in_flight_tokens = recorded["num_in_flight_tokens"]
    request.status = RequestStatus[recorded["status"]]
    pool = manager.block_pool
    held = {block_id for blocks, _, _ in inputs["groups"] if blocks for block_id in blocks}
    held.discard(pool.null_block.block_id)
    pool.get_new_blocks(max(0, pool.get_num_free_blocks() - free_blocks - len(held)))
    for single, (blocks, cached, _) in zip(manager.coordinator.single_type_managers,
                                           inputs["groups"], strict=True):
        if blocks is not None:
            single.req_to_blocks[request.request_id] = pool.get_new_blocks(len(blocks))
        if cached is not None:
            single.num_cached_block[request.request_id] = cached
    arguments = dict(inputs["arguments"])
    if arguments.get("new_computed_blocks") is not None:
        arguments["new_computed_blocks"] = KVCacheBlocks(tuple(
            [KVCacheBlock(block_id) for block_id in group]
            for group in arguments["new_computed_blocks"]))
    return manager, request, arguments


SHADOW = Shadow(snapshot=_snapshot, run=_run, outcome=_outcome, restore=_restore,
                compare=_compare, for_reproducer=_for_reproducer, check=_check)

PATCH = Patch(f"{MODULE}:KVCacheManager.allocate_slots", allocate_slots,
              fingerprints=VERIFIED_FINGERPRINTS, activation_check=activation_check,
              companions=COMPANION_FINGERPRINTS, shadow=SHADOW)
