"""Piece ``allocate_slots``: ``KVCacheManager.allocate_slots``'s decode fast answer.

Against the REAL installed vLLM scheduler (0.33.0 in tox -e vllm; 0.34.0, whose
requests keep their tokens in a ``TokenBuffer``, too), no model: the lockstep
harness (``scheduler_lockstep``) drives a stock scheduler and one whose KV
manager answers through fastbatch, with the same requests and model outputs,
and compares scheduler outputs, engine-core outputs, the whole KV-cache state
and every request after every step, over workloads that leave the fast path
(prefix caching on and off, async and sync scheduling, EOS, stop tokens,
min_tokens, max_tokens, aborts, preemption, chunked prefill, block
boundaries, arrivals every step, the scheduler's Model Runner V2 branches),
and spec decoding (``SPEC_WORKLOADS``: drafts of 0 to k tokens, all, some or
none accepted, lookahead slots, at block boundaries and at max_model_len).
Lookahead calls are also checked one by one against vLLM's method on real
KV-cache managers: those that fit in the held blocks, those that need one
block more, at block boundaries, with prefix caching on and off.
``FASTBATCH_LOCKSTEP_STEPS`` sets the total number of steps (default 2,000;
the report runs >= 10,000).
Each lockstep run, with the compiled piece or its pure-Python twin, asserts
from that implementation's own counters that it took requests, and that
the other implementation's counters did not move.

Also: the harness reports a planted one-token difference; compiled vs twin
on generated stand-ins (hypothesis), the method and the decision alone;
vLLM's signature, arguments forwarded as they came; the guard, the
activation check (which fails where the fast path took no call), bad input,
leaks; the plugin, by the piece's name and by its deprecated 0.1 name
``scheduler``.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import os
from array import array
from types import MethodType, SimpleNamespace

import pytest
import scheduler_lockstep as lockstep
from hypothesis import given
from hypothesis import strategies as st
from vllm.v1.core.kv_cache_manager import KVCacheManager

import fastbatch
from fastbatch import _kernels, _reference, registry, vllm_plugin
from fastbatch._kernels import allocate_slots as compiled_piece
from fastbatch._reference import allocate_slots as twin_piece
from fastbatch.patches import _stand_ins
from fastbatch.patches import allocate_slots as patch
from leaks import assert_no_leak

pytestmark = pytest.mark.vllm
STOCK = KVCacheManager.allocate_slots
TOTAL_STEPS = int(os.environ.get("FASTBATCH_LOCKSTEP_STEPS", "2000"))
STEPS_PER_WORKLOAD = max(1, TOTAL_STEPS // len(lockstep.WORKLOADS))


@pytest.fixture(autouse=True)
def _bound_to_vllm_afterwards():
    """Tests here bind the pieces to stand-ins: leave them bound to vLLM's
    method and classes, as the patch binds them."""
    yield
    patch.bind()
    twin_piece.bind(patch.PATCH.original() or STOCK, patch.kinds())


def make_fast(workload: lockstep.Workload, piece=compiled_piece):
    """A scheduler whose own KV manager answers through fastbatch's ``piece``
    (the class stays stock, so the other scheduler in this process is
    untouched)."""
    piece.bind(STOCK, patch.kinds())
    scheduler = lockstep.make_scheduler(workload)
    manager = scheduler.kv_cache_manager
    manager.allocate_slots = MethodType(piece.allocate_slots, manager)
    return scheduler


IDLE = {"noop_allocations": 0, "noop_lookahead_allocations": 0, "direct_allocations": 0,
        "stock_allocations": 0}


@pytest.mark.parametrize("workload", lockstep.WORKLOADS, ids=lambda w: w.name)
def test_lockstep_fast_path_matches_stock(workload):
    _kernels.reset_stats()
    _reference.reset_stats()
    harness = lockstep.Lockstep(workload, seed=12, make_fast=make_fast)
    harness.run(STEPS_PER_WORKLOAD)  # raises Divergence at the first difference
    counters = fastbatch.stats()["allocate_slots"]
    assert counters["noop_allocations"] > 0  # the fast path was taken
    assert counters["direct_allocations"] > 0  # new blocks or caching asked of vLLM's coordinator
    assert counters["stock_allocations"] > 0  # and left
    assert twin_piece.stats() == IDLE  # the twin never ran
    if workload.name.startswith("preemption"):
        assert harness.preemptions > 0


@pytest.mark.parametrize("workload", [lockstep.WORKLOADS[3], lockstep.WORKLOADS[6]],
                         ids=lambda w: w.name)
def test_lockstep_with_the_pure_python_twin(workload):
    _kernels.reset_stats()
    _reference.reset_stats()
    lockstep.Lockstep(workload, seed=5,
                      make_fast=lambda w: make_fast(w, twin_piece)).run(60)
    assert twin_piece.stats()["noop_allocations"] > 0  # the twin took requests
    assert twin_piece.stats()["direct_allocations"] > 0
    assert twin_piece.stats()["stock_allocations"] > 0  # and left some to vLLM
    assert compiled_piece.stats() == IDLE  # the compiled piece never ran


@pytest.mark.parametrize("workload", lockstep.SPEC_WORKLOADS, ids=lambda w: w.name)
def test_lockstep_spec_decode_matches_stock(workload):
    _kernels.reset_stats()
    _reference.reset_stats()
    harness = lockstep.Lockstep(workload, seed=12, make_fast=make_fast)
    harness.run(STEPS_PER_WORKLOAD)  # raises Divergence at the first difference
    counters = fastbatch.stats()["allocate_slots"]
    assert counters["noop_allocations"] > 0 and counters["stock_allocations"] > 0
    assert counters["direct_allocations"] > 0
    if workload.num_lookahead_tokens:
        # Every call of a running request carries the lookahead: the kernel took them.
        assert counters["noop_lookahead_allocations"] == counters["noop_allocations"]
    else:
        assert counters["noop_lookahead_allocations"] == 0
    assert twin_piece.stats() == IDLE
    if workload.name.endswith("preemption"):
        assert harness.preemptions > 0


def test_lockstep_spec_decode_with_the_pure_python_twin():
    _kernels.reset_stats()
    _reference.reset_stats()
    lockstep.Lockstep(lockstep.SPEC_WORKLOADS[1], seed=5,
                      make_fast=lambda w: make_fast(w, twin_piece)).run(60)
    counters = twin_piece.stats()
    assert counters["noop_lookahead_allocations"] > 0 and counters["stock_allocations"] > 0
    assert compiled_piece.stats() == IDLE


def test_harness_reports_a_planted_one_token_difference():
    def plant(step, engine_core_outputs):
        for outputs in engine_core_outputs.values():
            for output in outputs.outputs:
                if step >= 3 and output.new_token_ids:
                    output.new_token_ids[-1] += 1
                    return

    harness = lockstep.Lockstep(lockstep.WORKLOADS[2], seed=1)
    with pytest.raises(lockstep.Divergence,
                       match=r"step 3: engine_core_outputs\[0\]\.outputs\[0\]\.new_token_ids"):
        harness.run(50, tamper=plant)


def test_harness_reports_a_planted_request_token_difference():
    def plant(step, engine_core_outputs):
        if step == 6:
            harness.fast.running[0]._all_token_ids[-1] += 1

    harness = lockstep.Lockstep(lockstep.WORKLOADS[2], seed=1)
    with pytest.raises(lockstep.Divergence, match=r"step 6: requests\..*_all_token_ids"):
        harness.run(50, tamper=plant)


def test_harness_reports_a_planted_kv_state_difference():
    def plant(step, engine_core_outputs):
        if step == 5:
            single = harness.fast.kv_cache_manager.coordinator.single_type_managers[0]
            request_id = next(iter(single.num_cached_block))
            single.num_cached_block[request_id] += 1

    harness = lockstep.Lockstep(lockstep.WORKLOADS[0], seed=1)
    with pytest.raises(lockstep.Divergence, match=r"step 5: kv\.groups\[0\]\.num_cached_block"):
        harness.run(20, tamper=plant)


def test_stock_against_stock_is_equal():
    lockstep.Lockstep(lockstep.WORKLOADS[3], seed=2).run(40)


# Lookahead calls one by one against vLLM's method on real KV-cache managers --

def _running_request(piece_stock, caching, prompt_len, prefill_lookahead, ahead):
    """A small real manager (blocks of 4, 12 blocks, max_model_len 64) and a
    running request in it: its prompt prefilled (through vLLM's method, with
    ``prefill_lookahead`` slots), one token sampled, ``ahead`` more tokens
    computed than known (async scheduling's in-flight token)."""
    from vllm.v1.request import RequestStatus

    manager = _stand_ins.small_manager(caching)
    request = lockstep.make_request(lockstep.RequestSpec(
        "a", tuple(range(5, 5 + prompt_len)), 32, 0, (), False), 4)
    assert piece_stock(manager, request, prompt_len,
                       num_lookahead_tokens=prefill_lookahead) is not None
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens = prompt_len + ahead
    request.append_output_token_ids(40)
    return manager, request


def _answer(manager, result):
    return ("empty" if result is manager.empty_kv_cache_blocks
            else None if result is None else result.get_block_ids())


def _request_state(request):
    return (request.num_computed_tokens, request.num_tokens, len(request.block_hashes),
            request.status)


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-caching", "no-prefix-cache"])
@pytest.mark.parametrize("piece", [compiled_piece, twin_piece], ids=["compiled", "twin"])
def test_lookahead_calls_match_vllm_one_by_one(piece, caching):
    """Every (prompt, prefill lookahead, drafts, lookahead, in-flight) state
    of a grid: fastbatch's method and vLLM's on twin managers give the same
    answer and leave the same state; fastbatch answers "nothing" exactly when
    the held blocks cover the new tokens and the lookahead slots and no
    block of committed tokens is to be cached, plans every other call (new
    blocks, caching, both) without vLLM's method, and the grid holds calls
    that fit, that fit exactly (to the block boundary), and that need one
    block more."""
    piece.bind(STOCK, patch.kinds())
    seen = set()
    for prompt_len in range(1, 13):
        for prefill_lookahead in (0, 2, 3):
            for ahead in (0, 1):
                for num_drafts in range(4):
                    for lookahead in range(5):
                        sides = [_running_request(STOCK, caching, prompt_len,
                                                  prefill_lookahead, ahead)
                                 for _ in range(2)]
                        (stock_manager, stock_request), (manager, request) = sides
                        held = -(-(prompt_len + prefill_lookahead) // 4)
                        assert len(_stand_ins.kv_manager_state(manager)[0][0][0]["a"]) == held
                        num_new = 1 + num_drafts
                        need = prompt_len + ahead + num_new + lookahead
                        fits = -(-need // 4) <= held
                        caches = caching and (prompt_len + 1) % 4 == 0
                        before = piece.stats()
                        expected = _answer(stock_manager, STOCK(
                            stock_manager, stock_request, num_new,
                            num_lookahead_tokens=lookahead))
                        got = _answer(manager, piece.allocate_slots(
                            manager, request, num_new, num_lookahead_tokens=lookahead))
                        case = (prompt_len, prefill_lookahead, ahead, num_drafts, lookahead)
                        assert got == expected, case
                        assert (_stand_ins.kv_manager_state(manager)
                                == _stand_ins.kv_manager_state(stock_manager)), case
                        assert _request_state(request) == _request_state(stock_request)
                        after = piece.stats()
                        noop = after["noop_allocations"] - before["noop_allocations"]
                        assert noop == (fits and not caches), case
                        assert (after["noop_lookahead_allocations"]
                                - before["noop_lookahead_allocations"]
                                == (noop and lookahead > 0)), case
                        # Every other call is planned: new blocks or caching asked
                        # of vLLM's coordinator, vLLM's method never called.
                        assert (after["direct_allocations"] - before["direct_allocations"]
                                == 1 - noop), case
                        assert after["stock_allocations"] == before["stock_allocations"]
                        if noop:
                            assert expected == "empty"
                        if lookahead and fits:
                            seen.add("fits" if need < held * 4 else "fits exactly")
                        if lookahead and -(-need // 4) == held + 1:
                            assert expected not in ("empty", None)
                            assert sum(map(len, expected)) == 1  # one block more, vLLM's
                            seen.add("one block more")
                        if lookahead and fits and caches:
                            seen.add("fits, caches a block")
    assert seen == ({"fits", "fits exactly", "one block more", "fits, caches a block"}
                    if caching else {"fits", "fits exactly", "one block more"})


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-caching", "no-prefix-cache"])
def test_lookahead_slots_capped_at_max_model_len(caching):
    """vLLM caps the slots needed at max_model_len: a request whose blocks
    hold max_model_len tokens needs no block for lookahead slots past it, and
    fastbatch answers those calls itself."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import RequestStatus

    compiled_piece.bind(STOCK, patch.kinds())
    config = KVCacheConfig(num_blocks=12, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=4, num_kv_heads=1,
                                                      head_size=1, dtype=torch.float32))])
    capped = 0
    for prompt_len in range(9, 15):
        for num_drafts in range(16 - prompt_len):
            for lookahead in range(5):
                sides = []
                for _ in range(2):
                    manager = KVCacheManager(config, max_model_len=16, scheduler_block_size=4,
                                             hash_block_size=4, enable_caching=caching)
                    request = lockstep.make_request(lockstep.RequestSpec(
                        "a", tuple(range(5, 5 + prompt_len)), 8, 0, (), False), 4)
                    STOCK(manager, request, prompt_len, num_lookahead_tokens=4)  # 4 blocks
                    request.status = RequestStatus.RUNNING
                    request.num_computed_tokens = prompt_len
                    request.append_output_token_ids(40)
                    sides.append((manager, request))
                (stock_manager, stock_request), (manager, request) = sides
                need = prompt_len + 1 + num_drafts + lookahead
                caches = caching and (prompt_len + 1) % 4 == 0
                before = compiled_piece.stats()["noop_allocations"]
                expected = _answer(stock_manager, STOCK(stock_manager, stock_request,
                                                        1 + num_drafts,
                                                        num_lookahead_tokens=lookahead))
                got = _answer(manager, compiled_piece.allocate_slots(
                    manager, request, 1 + num_drafts, num_lookahead_tokens=lookahead))
                assert got == expected == "empty"  # 4 blocks hold max_model_len
                assert (_stand_ins.kv_manager_state(manager)
                        == _stand_ins.kv_manager_state(stock_manager))
                noop = compiled_piece.stats()["noop_allocations"] - before
                assert noop == (not caches)
                capped += noop and need > 16
    assert capped > 0


def test_lookahead_calls_over_many_steps_match_vllm():
    """Long runs of spec decode steps (drafts verified, some rejected,
    lookahead slots) on real managers, to max_model_len, stock and fastbatch
    side by side (the activation check's run, longer)."""
    for caching in (True, False):
        for lookahead in (1, 2, 3, 5):
            compiled_piece.reset_stats()
            assert patch._side_by_side(STOCK, patch.allocate_slots, caching, lookahead) is None
            assert compiled_piece.stats()["noop_lookahead_allocations"] > 0


def test_activation_check_refuses_a_kernel_that_ignores_lookahead():
    def ignores_lookahead(self, request, num_new_tokens, **kwargs):
        """A kernel whose decision leaves the lookahead slots out."""
        reserved = kwargs.get("reserved_blocks", 0)
        if _kernels.allocate_slots_is_noop(self, request, num_new_tokens, reserved,
                                           patch.kinds()):
            return self.empty_kv_cache_blocks
        return patch.allocate_slots(self, request, num_new_tokens, **kwargs)

    problem = patch.activation_check(STOCK, ignores_lookahead)
    assert problem is not None and "lookahead 2" in problem


# Stand-ins for the pure decision (compiled vs twin); the real path is the
# lockstep above.  The pinned kinds' stand-ins have only the fields the
# compiled call reads directly (no accessor to call), the others only the
# accessors.
class _Manager:
    def create_kv_cache_blocks(self, blocks):
        return ("created", blocks)


class _Coordinator:
    """Records what fastbatch asks of vLLM's coordinator."""

    def allocate_new_blocks(self, *args):
        self.calls.append(("allocate_new_blocks", *args))
        return (["a new block"],)

    def cache_blocks(self, request, num_tokens):
        self.calls.append(("cache_blocks", request.request_id, num_tokens))


class _Single:
    pass


class _Pool:
    pass


class _Request:
    pass


class _Spec:
    pass


RUNNING, WAITING = object(), object()
KINDS = (_Manager, (_Coordinator,), _Single, _Pool, _Request, _Spec, RUNNING)


class _Tokens(array):
    """vLLM 0.34.0's ``TokenBuffer`` as the compiled call meets it: a
    subclass of ``array('i')`` whose slices are lists."""

    __slots__ = ()

    def __new__(cls, tokens=()):
        return super().__new__(cls, "i", tokens)

    def __getitem__(self, index):
        item = array.__getitem__(self, index)
        return item.tolist() if isinstance(index, slice) else item


def _stand_in(num_blocks, num_computed, num_new, max_model_len, block_size, hash_block_size,
              num_cached, num_tokens, reprefillable, free, caching, cacheable, running,
              has_blocks, partial_hit, pinned=(True, True, True), token_buffer=False):
    pinned_pool, pinned_request, pinned_spec = pinned
    if pinned_pool:
        pool = _Pool()
        pool.free_block_queue = SimpleNamespace(num_free_blocks=free)
    else:
        pool = SimpleNamespace(get_num_free_blocks=lambda: free)
    pool.hash_block_size = hash_block_size
    single = _Single()
    single.req_to_blocks = {"r": [object()] * num_blocks} if has_blocks else {}
    single._partial_hit_reqs = {"r": None} if partial_hit else {}
    single.num_cached_block = {"r": num_cached}
    single.block_size, single.block_pool, single.enable_caching = block_size, pool, caching
    if pinned_spec and cacheable:
        single.kv_cache_spec = _Spec()
    else:
        single.kv_cache_spec = SimpleNamespace(prefix_cacheable=cacheable)
    coordinator = _Coordinator()
    coordinator.calls = []
    coordinator.single_type_managers = (single,)
    coordinator.num_reprefillable_tokens = reprefillable
    manager = _Manager()
    manager.coordinator, manager.block_pool = coordinator, pool
    manager.max_model_len = max_model_len
    manager.empty_kv_cache_blocks = SimpleNamespace(blocks=((),))
    request = _Request() if pinned_request else SimpleNamespace(num_tokens=num_tokens)
    if pinned_request:
        # A list (vLLM up to 0.33.0) or an int32 array (0.34.0's TokenBuffer).
        request._all_token_ids = (_Tokens if token_buffer else list)([0] * num_tokens)
    request.request_id, request.status = "r", RUNNING if running else WAITING
    request.num_computed_tokens = num_computed
    return manager, request


def _recording_stock(calls):
    def stock(*args):
        calls.append(args)
        return calls

    return stock


@given(st.integers(0, 6), st.integers(0, 40), st.integers(-1, 5), st.integers(1, 48),
       st.sampled_from([1, 4, 16]), st.sampled_from([4, 16]), st.integers(0, 6),
       st.integers(0, 48), st.integers(0, 2), st.integers(0, 3),
       st.booleans(), st.booleans(), st.booleans(), st.booleans(), st.booleans(),
       st.integers(0, 4), st.tuples(st.booleans(), st.booleans(), st.booleans()),
       st.one_of(st.integers(0, 8), st.sampled_from([-1, 2**30, 2**40, 0.0, 1.0, False,
                                                      True, None])),
       st.booleans())
def test_compiled_matches_twin(num_blocks, num_computed, num_new, max_model_len, block_size,
                               hash_block_size, num_cached, num_tokens, reprefillable, free,
                               caching, cacheable, running, has_blocks, partial_hit, reserved,
                               pinned, lookahead, token_buffer):
    manager, request = _stand_in(num_blocks, num_computed, num_new, max_model_len, block_size,
                                 hash_block_size, num_cached, num_tokens, reprefillable, free,
                                 caching, cacheable, running, has_blocks, partial_hit, pinned,
                                 token_buffer)
    expected = _reference.allocate_slots_is_noop(manager, request, num_new, reserved, KINDS)
    assert _kernels.allocate_slots_is_noop(manager, request, num_new, reserved,
                                           KINDS) is expected
    with_lookahead = _reference.allocate_slots_is_noop(manager, request, num_new, reserved,
                                                       KINDS, lookahead)
    assert _kernels.allocate_slots_is_noop(manager, request, num_new, reserved, KINDS,
                                           num_lookahead_tokens=lookahead) is with_lookahead
    if not (type(lookahead) is int and 0 <= lookahead < 2**30):
        assert with_lookahead is False  # vLLM's code decides
    elif with_lookahead:
        assert expected  # lookahead slots only ever take a yes away
    # The method: the same decision, and vLLM's method (here a recorder) otherwise.
    results = []
    for piece in (compiled_piece, twin_piece):
        calls = []
        piece.bind(_recording_stock(calls), KINDS)
        manager.coordinator.calls = []
        result = piece.allocate_slots(manager, request, num_new, reserved_blocks=reserved,
                                      num_lookahead_tokens=lookahead)
        results.append((result is manager.empty_kv_cache_blocks, calls,
                        manager.coordinator.calls, result if result is not calls else None))
    assert results[0] == results[1]
    empty, stock_calls, asked, _ = results[0]
    # Nothing done, vLLM's method called, or vLLM's coordinator asked: one of them.
    assert (empty and not asked) + bool(stock_calls) + bool(asked) == 1
    assert (empty and not asked) is with_lookahead


def test_compiled_matches_twin_on_a_lookahead_grid():
    """Every held-block count, computed count, new count, block size and
    lookahead of a grid (a running request, caching on and off): the same
    decision, and the lookahead slots take some yeses away."""
    taken_away = 0
    for num_blocks, num_computed, num_new, block_size, lookahead, caching in itertools.product(
            range(5), range(0, 41, 3), range(-1, 6), (1, 4, 16), range(9), (True, False)):
        manager, request = _stand_in(num_blocks, num_computed, num_new, 48, block_size, 4, 6,
                                     48, 0, 3, caching, True, True, True, False)
        expected = _reference.allocate_slots_is_noop(manager, request, num_new, 0, KINDS,
                                                     lookahead)
        assert _kernels.allocate_slots_is_noop(manager, request, num_new, 0, KINDS,
                                               lookahead) is expected
        taken_away += (not expected and _reference.allocate_slots_is_noop(
            manager, request, num_new, 0, KINDS))
    assert taken_away > 0


def _defaults_stand_in():
    return _stand_in(1, 3, 1, 64, 4, 4, 1, 4, 0, 3, True, True, True, True, False)


@pytest.mark.parametrize("piece", [compiled_piece, twin_piece], ids=["compiled", "twin"])
def test_signature_is_vllms(piece):
    def parameters(function):
        return [(p.name, p.kind, p.default)
                for p in inspect.signature(function).parameters.values()]

    assert parameters(piece.allocate_slots) == parameters(STOCK)


@pytest.mark.parametrize("piece", [compiled_piece, twin_piece], ids=["compiled", "twin"])
def test_every_argument_is_forwarded_as_it_came(piece):
    manager, request = _defaults_stand_in()
    calls = []
    piece.bind(_recording_stock(calls), KINDS)
    assert piece.allocate_slots(manager, request, 1) is manager.empty_kv_cache_blocks
    assert calls == []
    defaults = [p.default for p in inspect.signature(STOCK).parameters.values()][3:]
    # One argument off its default at a time (as a truthy or other object):
    # vLLM's method answers, with every argument as given.
    names = list(inspect.signature(STOCK).parameters)[3:]
    others = {"new_computed_blocks": object(), "delay_cache_blocks": 0,
              "full_sequence_must_fit": None, "num_lookahead_tokens": 0.0,
              "num_new_computed_tokens": 1, "num_external_computed_tokens": True,
              "num_encoder_tokens": 2}
    for name, value in others.items():
        calls.clear()
        assert piece.allocate_slots(manager, request, 1, **{name: value}) is calls
        expected = [value if other == name else default
                    for other, default in zip(names, defaults, strict=True)]
        assert calls == [(manager, request, 1, *expected)]
        assert calls[0][3 + names.index(name)] is value
    # A lookahead that fits in the held block (3 computed + 1 new + 0): no call;
    # one that does not (a second block), or not an int >= 0: vLLM's method.
    assert piece.allocate_slots(manager, request, 1, num_lookahead_tokens=0) \
        is manager.empty_kv_cache_blocks
    for value in (-1, 2**40, True):
        calls.clear()
        assert piece.allocate_slots(manager, request, 1, num_lookahead_tokens=value) is calls
        assert calls[0][3 + names.index("num_lookahead_tokens")] is value
    # 1 and 5 lookahead slots need 1 and 2 blocks more: vLLM's coordinator is
    # asked for them with vLLM's counts (slots, main-model tokens, encoder tokens).
    for value, slots in ((1, 5), (5, 9)):
        calls.clear()
        manager.coordinator.calls = []
        assert piece.allocate_slots(manager, request, 1, num_lookahead_tokens=value) == (
            "created", (["a new block"],))
        assert calls == []
        assert manager.coordinator.calls == [("allocate_new_blocks", "r", slots, 4, 0)]
    request.num_computed_tokens = 2
    assert piece.allocate_slots(manager, request, 1, num_lookahead_tokens=1) \
        is manager.empty_kv_cache_blocks
    request.num_computed_tokens = 3
    # The two arguments that do not matter for a running request: still a no-op.
    calls.clear()
    assert piece.allocate_slots(manager, request, 1, has_scheduled_reqs=False,
                                skip_zeroing_group_ids=(0,)) is manager.empty_kv_cache_blocks
    assert calls == []
    sentinel = object()
    request.status = WAITING
    assert piece.allocate_slots(manager, request, 1, 0, None, 0, 0, False, 0, False, 0,
                                sentinel, ()) is calls
    assert calls[0][-2] is sentinel


@pytest.mark.parametrize("implementation", [_kernels, _reference], ids=["compiled", "twin"])
def test_bad_input(implementation):
    manager, request = _defaults_stand_in()
    assert implementation.allocate_slots_is_noop(manager, request, 1, 0, KINDS) is True
    with pytest.raises(ValueError, match="kinds must have 7 items"):
        implementation.allocate_slots_is_noop(manager, request, 1, 0, KINDS[:3])
    with pytest.raises(TypeError, match="kinds must be a tuple"):
        implementation.allocate_slots_is_noop(manager, request, 1, 0, list(KINDS))
    with pytest.raises(TypeError, match="kinds must hold types"):
        implementation.allocate_slots_is_noop(manager, request, 1, 0,
                                              (_Manager, (_Coordinator,), 3, *KINDS[3:]))
    # Anything not exactly vLLM's plain kinds, or not an int: not a no-op (stock runs).
    assert implementation.allocate_slots_is_noop(object(), request, 1, 0, KINDS) is False
    assert implementation.allocate_slots_is_noop(manager, request, 1.0, 0, KINDS) is False
    assert implementation.allocate_slots_is_noop(manager, request, True, 0, KINDS) is False
    assert implementation.allocate_slots_is_noop(manager, request, 2**40, 0, KINDS) is False
    assert implementation.allocate_slots_is_noop(manager, request, 1, -2**40, KINDS) is False


@pytest.mark.parametrize("piece", [compiled_piece, twin_piece], ids=["compiled", "twin"])
def test_bind_refuses_bad_input_and_keeps_the_binding(piece):
    manager, request = _defaults_stand_in()
    calls = []
    piece.bind(_recording_stock(calls), KINDS)
    with pytest.raises(TypeError, match="stock must be callable"):
        piece.bind(None, KINDS)
    with pytest.raises(ValueError, match="kinds must have 7 items"):
        piece.bind(_recording_stock([]), KINDS[:6])
    request.status = WAITING
    assert piece.allocate_slots(manager, request, 1) is calls


def test_no_leaks():
    manager, request = _defaults_stand_in()
    for _ in range(100):
        _kernels.allocate_slots_is_noop(manager, request, 1, 0, KINDS)
    assert_no_leak(lambda: _kernels.allocate_slots_is_noop(manager, request, 1, 0, KINDS),
                   [manager, request, KINDS], 2000)
    compiled_piece.bind(lambda *args: None, KINDS)
    assert_no_leak(lambda: compiled_piece.allocate_slots(manager, request, 1),
                   [manager, request], 2000)
    # A planned call: vLLM's coordinator asked for a block (a stand-in that
    # keeps nothing), the result made by the manager's create_kv_cache_blocks.
    manager.coordinator.calls = SimpleNamespace(append=lambda call: None)
    assert_no_leak(lambda: compiled_piece.allocate_slots(manager, request, 1,
                                                         num_lookahead_tokens=1),
                   [manager, request], 2000)
    waiting = SimpleNamespace(**vars(request))
    waiting.status = WAITING
    assert_no_leak(lambda: compiled_piece.allocate_slots(manager, waiting, 1, 0, None, 0,
                                                         0, False, 0, False, 0, True, ()),
                   [manager, waiting], 2000)


def test_guard_accepts_this_vllm_and_refuses_a_changed_method():
    import vllm

    assert patch.PATCH.check_target(vllm.__version__, STOCK) is None
    assert "not a verified variant" in patch.PATCH.check_target(vllm.__version__, make_fast)
    # A release after the newest one the release tool accepts for the target.
    newest = max(patch.PATCH.versions, key=lambda version: tuple(map(int, version.split("."))))
    major, minor, _ = map(int, newest.split("."))
    unknown = f"{major}.{minor + 1}.0"
    assert "not a verified version" in patch.PATCH.check_target(unknown, STOCK)
    assert patch.overridden_methods() == []


def test_activation_check_passes_and_refuses_a_wrong_kernel():
    compiled_piece.reset_stats()
    assert patch.activation_check(STOCK, patch.allocate_slots) is None
    counters = compiled_piece.stats()  # the compiled piece took the check's calls
    assert counters["noop_allocations"] > counters["noop_lookahead_allocations"] > 0
    assert counters["direct_allocations"] > 0 and counters["stock_allocations"] > 0

    def always_empty(self, request, num_new_tokens, **ignored):
        return self.empty_kv_cache_blocks

    assert patch.activation_check(STOCK, always_empty) is not None


def test_activation_check_refuses_a_kernel_that_hands_every_call_to_vllm():
    """vLLM's own method as the replacement: every result matches, and the
    check still fails, because the fast path took nothing."""
    problem = patch.activation_check(STOCK, STOCK)
    assert problem is not None and "never answered a decode call itself" in problem
    assert "planned an allocation or caching itself" in problem


def test_activation_check_refuses_a_kernel_bound_to_classes_it_does_not_meet(monkeypatch):
    """The compiled piece bound to a manager class that is not the one in use
    (as after vLLM renamed or replaced it): it hands every call back, its
    results are vLLM's, and the check says the fast path took nothing."""
    real = patch.kinds()
    monkeypatch.setattr(patch, "kinds", lambda: (type("OtherManager", (), {}), *real[1:]))
    problem = patch.activation_check(STOCK, patch.allocate_slots)
    assert problem is not None and "does not take this vLLM's requests" in problem


def test_activation_check_refuses_a_kernel_that_never_plans(monkeypatch):
    """A kernel that answers the no-op calls but hands every call that needs
    a block or caching back: the check requires the planned path too."""
    def never_plans(self, request, num_new_tokens, **kwargs):
        reserved = kwargs.get("reserved_blocks", 0)
        lookahead = kwargs.get("num_lookahead_tokens", 0)
        if compiled_piece.allocate_slots_is_noop(self, request, num_new_tokens, reserved,
                                                 patch.kinds(), lookahead):
            return self.empty_kv_cache_blocks
        return STOCK(self, request, num_new_tokens, **kwargs)

    problem = patch.activation_check(STOCK, never_plans)
    assert problem is not None and "never planned an allocation" in problem
    assert "answered a decode call" not in problem


def test_plugin_applies_and_reverts(monkeypatch):
    piece = registry.piece("allocate_slots")
    assert piece.patches == (patch.PATCH,)
    monkeypatch.setenv("FASTBATCH", "1")
    monkeypatch.setenv("FASTBATCH_DISABLE",
                       "async_output_token_ids async_spec_token_ids penalty_output_tokens")
    try:
        vllm_plugin.register()
        assert piece.is_applied() and KVCacheManager.allocate_slots is patch.allocate_slots
        assert vllm_plugin.status()["patches"]["allocate_slots"] is True
    finally:
        piece.revert()
    assert KVCacheManager.allocate_slots is STOCK
    assert not piece.is_applied()
    monkeypatch.setenv("FASTBATCH_DISABLE", "allocate_slots")
    try:
        vllm_plugin.register()
        assert KVCacheManager.allocate_slots is STOCK
        assert vllm_plugin.status()["patches"]["allocate_slots"] is False
    finally:
        vllm_plugin.revert()



# FASTBATCH_VERIFY: the shadow check ------------------------------------------
# The patch is applied on the class with verify on; its checked method is then
# bound on the fast side's own manager only, and the class put back to vLLM's
# method for the stock side (the check runs vLLM's method on the fast side's
# live state).

VERIFY_WORKLOADS = lockstep.WORKLOADS + lockstep.SPEC_WORKLOADS
VERIFY_STEPS = max(40, STEPS_PER_WORKLOAD // 2)


@pytest.fixture
def verified(monkeypatch, tmp_path):
    """``verified(rate)``: the piece applied with verify ``rate`` and a
    ``make_fast`` that binds its checked method on the fast side only;
    reproducers go to tmp_path.  Stock again afterwards."""
    monkeypatch.setenv("FASTBATCH_VERIFY_DIR", str(tmp_path))
    assert registry.piece("allocate_slots").patches == (patch.PATCH,)  # names it
    patch.PATCH.revert()
    applied = []

    def apply(rate=1.0):
        assert patch.PATCH.apply(verify=rate)
        checked = KVCacheManager.allocate_slots
        assert getattr(checked, "__fastbatch__", False) and checked is not patch.allocate_slots
        KVCacheManager.allocate_slots = STOCK
        applied.append(checked)

        def make_fast_checked(workload):
            scheduler = lockstep.make_scheduler(workload)
            manager = scheduler.kv_cache_manager
            manager.allocate_slots = MethodType(checked, manager)
            return scheduler

        return make_fast_checked

    yield apply
    if applied:
        KVCacheManager.allocate_slots = applied[0]
    patch.PATCH.revert()
    assert KVCacheManager.allocate_slots is STOCK


@pytest.mark.parametrize("workload", VERIFY_WORKLOADS, ids=lambda w: w.name)
def test_verify_no_false_divergence_in_lockstep(verified, workload):
    make_fast_checked = verified(1.0)
    _kernels.reset_stats()
    harness = lockstep.Lockstep(workload, seed=31, make_fast=make_fast_checked)
    harness.run(VERIFY_STEPS)  # the fast side's state stays stock's
    counters = fastbatch.stats()["allocate_slots"]
    assert counters["noop_allocations"] > 0 and counters["stock_allocations"] > 0
    assert counters["direct_allocations"] > 0
    # Every call that fastbatch answered or planned itself was checked, no other.
    assert patch.PATCH.checked == counters["noop_allocations"] + counters["direct_allocations"]
    assert patch.PATCH.divergences == 0 and patch.PATCH.reproducers == []


def allocates_a_block_too_many(real):
    """fastbatch's answer, except that a planned call (new blocks or caching
    asked of vLLM's coordinator) also takes one block more for the request."""
    def buggy(self, request, *args, **kwargs):
        planned = fastbatch.stats()["allocate_slots"]["direct_allocations"]
        result = real(self, request, *args, **kwargs)
        if fastbatch.stats()["allocate_slots"]["direct_allocations"] != planned:
            (single,) = self.coordinator.single_type_managers
            held = len(single.req_to_blocks[request.request_id])
            self.coordinator.allocate_new_blocks(request.request_id,
                                                 (held + 1) * single.block_size, 0)
        return result
    return buggy


def test_verify_catches_a_planned_call_that_changes_too_much(verified, monkeypatch, logs):
    """A planted bug in a planned call: vLLM's method runs on a rebuilt
    manager and is compared by counts; the divergence is reported, the
    planned blocks stand (the live state cannot be rolled back: the
    lockstep sees the extra block) and vLLM's method runs from then on."""
    make_fast_checked = verified(1.0)
    real = patch.PATCH.replacement
    monkeypatch.setattr(patch.PATCH, "replacement", allocates_a_block_too_many(real))
    harness = lockstep.Lockstep(lockstep.WORKLOADS[0], seed=3, make_fast=make_fast_checked)
    with pytest.raises(lockstep.Divergence):
        while harness.steps < 400:
            harness.step()
    assert patch.PATCH.divergences == 1
    (error,) = [line for line in logs.at(logging.ERROR) if "FASTBATCH_VERIFY" in line]
    assert "'allocate_slots'" in error and "changed" in error


def claims_nothing_to_allocate_late(real):
    """fastbatch's answer, except that a running request with 100 computed
    tokens or more (the activation check's requests never get there) is told
    "nothing to allocate" even where it needs a block."""
    def buggy(self, request, num_new_tokens, *args, **kwargs):
        if request.num_computed_tokens >= 100 and not args and not any(
                kwargs.get(name) for name in ("num_lookahead_tokens", "new_computed_blocks",
                                              "num_new_computed_tokens")):
            return self.empty_kv_cache_blocks
        return real(self, request, num_new_tokens, *args, **kwargs)
    return buggy


def test_verify_planted_bug_is_caught_and_vllm_result_stands(verified, monkeypatch, logs):
    make_fast_checked = verified(1.0)
    real = patch.PATCH.replacement
    # planted after apply: the activation check passed on the real piece
    monkeypatch.setattr(patch.PATCH, "replacement", claims_nothing_to_allocate_late(real))
    stock_calls = []
    harness = lockstep.Lockstep(lockstep.WORKLOADS[0], seed=3, make_fast=make_fast_checked)
    # The lockstep compares every step: the fast side's KV cache, block
    # tables and scheduler outputs (the call's returned blocks) stay stock's.
    while patch.PATCH.divergences == 0 and harness.steps < 400:
        harness.step()
    assert patch.PATCH.divergences == 1
    (path,) = patch.PATCH.reproducers
    assert os.path.dirname(path) == os.environ["FASTBATCH_VERIFY_DIR"]
    (error,) = [line for line in logs.at(logging.ERROR) if "FASTBATCH_VERIFY" in line]
    assert "'allocate_slots'" in error and "returned 'empty_kv_cache_blocks'" in error
    # From now on every call goes to vLLM's method: fastbatch's is not called.
    checked = patch.PATCH.checked

    def must_not_run(*args, **kwargs):
        stock_calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(patch.PATCH, "replacement", must_not_run)
    harness.run(30)
    assert stock_calls == [] and patch.PATCH.checked == checked
    assert patch.PATCH.divergences == 1
    monkeypatch.setattr(patch.PATCH, "replacement", claims_nothing_to_allocate_late(real))
    # The reproducer replays the divergence, and no longer once the bug is gone.
    problem = vllm_plugin.replay(path)
    assert problem is not None and "returned 'empty_kv_cache_blocks'" in problem
    monkeypatch.setattr(patch.PATCH, "replacement", real)
    assert vllm_plugin.replay(path) is None


def test_verify_catches_a_decision_that_leaves_the_lookahead_out(verified, monkeypatch):
    """A planted bug in the new case: "nothing to allocate" where the new
    tokens fit but the lookahead slots need a block.  The shadow check
    catches it at once and vLLM's allocation stands (the lockstep sees no
    difference)."""
    make_fast_checked = verified(1.0)
    real = patch.PATCH.replacement

    def ignores_lookahead(self, request, num_new_tokens, *args, **kwargs):
        if not args and _kernels.allocate_slots_is_noop(
                self, request, num_new_tokens, kwargs.get("reserved_blocks", 0),
                patch.kinds()):
            return self.empty_kv_cache_blocks
        return real(self, request, num_new_tokens, *args, **kwargs)

    monkeypatch.setattr(patch.PATCH, "replacement", ignores_lookahead)
    harness = lockstep.Lockstep(lockstep.SPEC_WORKLOADS[0], seed=3,
                                make_fast=make_fast_checked)
    while patch.PATCH.divergences == 0 and harness.steps < 200:
        harness.step()
    assert patch.PATCH.divergences == 1
    harness.run(20)  # vLLM's method from now on, the state still stock's
    (path,) = patch.PATCH.reproducers
    problem = vllm_plugin.replay(path)
    assert problem is not None and "returned 'empty_kv_cache_blocks'" in problem
    monkeypatch.setattr(patch.PATCH, "replacement", real)
    assert vllm_plugin.replay(path) is None


def test_verify_divergence_returns_vllms_blocks_and_keeps_its_allocation(verified, monkeypatch):
    """One call, by hand: fastbatch wrongly says "nothing to allocate" at a
    block boundary; the call returns vLLM's new block, which vLLM's method
    put in the request's block table, exactly as a stock call does."""
    verified(1.0)
    from vllm.v1.request import RequestStatus

    sides = []
    for _ in range(2):
        manager, request = _stand_ins.small_manager(True), _stand_ins.hashed_request("a")
        manager.allocate_slots(request, request.num_tokens)  # the prompt: 2 blocks of 4
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = request.num_tokens
        request.append_output_token_ids([30, 31])  # 8 tokens: the next one needs block 3
        request.num_computed_tokens = 8
        request.append_output_token_ids(32)
        sides.append((manager, request))
    (stock_manager, stock_request), (manager, request) = sides
    expected = STOCK(stock_manager, stock_request, 1)
    assert expected is not stock_manager.empty_kv_cache_blocks  # a new block

    def always_empty(self, request, num_new_tokens, *args, **kwargs):
        return self.empty_kv_cache_blocks

    monkeypatch.setattr(patch.PATCH, "replacement", always_empty)
    checked_method = _checked_method()
    got = checked_method(manager, request, 1)
    assert patch.PATCH.divergences == 1 and patch.PATCH.checked == 1
    assert got.get_block_ids() == expected.get_block_ids()
    assert _stand_ins.kv_manager_state(manager) == _stand_ins.kv_manager_state(stock_manager)
    # The next call goes to vLLM's method (always_empty would answer otherwise).
    request.num_computed_tokens += 1
    request.append_output_token_ids(33)
    stock_request.num_computed_tokens += 1
    stock_request.append_output_token_ids(33)
    assert (checked_method(manager, request, 1).get_block_ids()
            == STOCK(stock_manager, stock_request, 1).get_block_ids())
    assert patch.PATCH.checked == 1


def _checked_method(rate=1.0):
    """The piece's checked method, as ``apply(verify=rate)`` installs it."""
    from fastbatch import _verify

    return _verify.checked_replacement(patch.PATCH, STOCK, rate)


def test_verify_calls_handed_to_vllm_are_not_checked_nor_run_twice(verified, monkeypatch):
    verified(1.0)
    calls = []

    def counting_stock(*args):
        calls.append(args[1].request_id)
        return STOCK(*args)

    compiled_piece.bind(counting_stock, patch.kinds())
    manager, request = _stand_ins.small_manager(True), _stand_ins.hashed_request("a")
    checked = _checked_method()
    result = checked(manager, request, request.num_tokens)  # a prefill: vLLM's method
    assert result is not None and calls == ["a"] and patch.PATCH.checked == 0


def test_verify_sampled_rate_checks_some_calls(verified):
    from vllm.v1.request import RequestStatus

    verified(1.0)  # applied (and bound to vLLM's method); the rate is forced below
    for rate, low, high in ((0.5, 1, 59), (1.0, 60, 60), (0.0, 0, 0)):
        patch.PATCH.checked = 0
        checked = _checked_method(rate)
        for index in range(60):
            manager = _stand_ins.small_manager(True)
            request = _stand_ins.hashed_request(f"r{index}")
            STOCK(manager, request, request.num_tokens)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = request.num_tokens
            request.append_output_token_ids(40)
            checked(manager, request, 1)  # a no-op: 7 tokens in 2 blocks of 4
        assert low <= patch.PATCH.checked <= high
        assert patch.PATCH.divergences == 0



def test_verify_suspended_calls_are_not_checked(verified):
    """``_verify.suspended()`` (for other pieces' activation checks, which run
    real managers through the installed method): fastbatch's answer, unchecked."""
    from vllm.v1.request import RequestStatus

    from fastbatch import _verify

    verified(1.0)
    checked = _checked_method()
    manager, request = _stand_ins.small_manager(True), _stand_ins.hashed_request("a")
    STOCK(manager, request, request.num_tokens)
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens = request.num_tokens
    request.append_output_token_ids(40)
    with _verify.suspended():
        assert checked(manager, request, 1) is manager.empty_kv_cache_blocks
    assert patch.PATCH.checked == 0
    assert checked(manager, request, 1) is manager.empty_kv_cache_blocks
    assert patch.PATCH.checked == 1
