"""Piece ``scheduler``: ``KVCacheManager.allocate_slots``'s decode fast answer.

Against the REAL vLLM 0.33.0 scheduler (tox -e vllm), no model: the lockstep
harness (``scheduler_lockstep``) drives a stock scheduler and one whose KV
manager answers through fastbatch, with the same requests and model outputs,
and compares scheduler outputs, engine-core outputs, the whole KV-cache state
and every request after every step, over workloads that leave the fast path
(prefix caching on and off, async and sync scheduling, EOS, stop tokens,
min_tokens, max_tokens, aborts, preemption, chunked prefill, block
boundaries, arrivals every step, the scheduler's Model Runner V2 branches).
``FASTBATCH_LOCKSTEP_STEPS`` sets the total number of steps (default 2,000;
the report runs >= 10,000).

Also: the harness reports a planted one-token difference; compiled vs twin
on generated stand-ins (hypothesis); the guard, the activation check, bad
input, leaks.
"""

from __future__ import annotations

import importlib
import os
from types import MethodType, SimpleNamespace

import pytest
import scheduler_lockstep as lockstep
from hypothesis import given
from hypothesis import strategies as st
from vllm.v1.core.kv_cache_manager import KVCacheManager

import fastbatch
from fastbatch import _kernels, _reference, vllm_plugin
from fastbatch.patches import decode_slots as patch
from leaks import assert_no_leak

pytestmark = pytest.mark.vllm
STOCK = KVCacheManager.allocate_slots
TOTAL_STEPS = int(os.environ.get("FASTBATCH_LOCKSTEP_STEPS", "2000"))
STEPS_PER_WORKLOAD = max(1, TOTAL_STEPS // len(lockstep.WORKLOADS))


def make_fast(workload: lockstep.Workload):
    """A scheduler whose own KV manager answers through fastbatch (the class
    stays stock, so the other scheduler in this process is untouched)."""
    scheduler = lockstep.make_scheduler(workload)
    manager = scheduler.kv_cache_manager
    manager.allocate_slots = MethodType(patch.allocate_slots, manager)
    return scheduler


@pytest.mark.parametrize("workload", lockstep.WORKLOADS, ids=lambda w: w.name)
def test_lockstep_fast_path_matches_stock(workload):
    fastbatch.reset_stats()
    harness = lockstep.Lockstep(workload, seed=12, make_fast=make_fast)
    harness.run(STEPS_PER_WORKLOAD)  # raises Divergence at the first difference
    counters = fastbatch.stats()
    assert counters["scheduler_noop_allocations"] > 0  # the fast path was taken
    assert counters["scheduler_stock_allocations"] > 0  # and left
    if workload.name.startswith("preemption"):
        assert harness.preemptions > 0


@pytest.mark.parametrize("workload", [lockstep.WORKLOADS[3], lockstep.WORKLOADS[6]],
                         ids=lambda w: w.name)
def test_lockstep_with_the_pure_python_twin(monkeypatch, workload):
    monkeypatch.setattr(fastbatch, "allocate_slots_is_noop", _reference.allocate_slots_is_noop)
    lockstep.Lockstep(workload, seed=5, make_fast=make_fast).run(60)


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


# Stand-ins for the pure decision (compiled vs twin); the real path is the
# lockstep above.
class _Manager:
    pass


class _Coordinator:
    pass


class _Single:
    pass


RUNNING, WAITING = object(), object()
KINDS = (_Manager, (_Coordinator,), _Single, RUNNING)


def _stand_in(num_blocks, num_computed, num_new, max_model_len, block_size, hash_block_size,
              num_cached, num_hashes, num_tokens, reprefillable, free, caching, cacheable,
              running, has_blocks, partial_hit):
    pool = SimpleNamespace(hash_block_size=hash_block_size, get_num_free_blocks=lambda: free)
    single = _Single()
    single.req_to_blocks = {"r": [object()] * num_blocks} if has_blocks else {}
    single._partial_hit_reqs = {"r": None} if partial_hit else {}
    single.num_cached_block = {"r": num_cached}
    single.block_size, single.block_pool, single.enable_caching = block_size, pool, caching
    single.kv_cache_spec = SimpleNamespace(prefix_cacheable=cacheable)
    coordinator = _Coordinator()
    coordinator.single_type_managers = (single,)
    coordinator.num_reprefillable_tokens = reprefillable
    manager = _Manager()
    manager.coordinator, manager.block_pool = coordinator, pool
    manager.max_model_len = max_model_len
    request = SimpleNamespace(request_id="r", status=RUNNING if running else WAITING,
                              num_computed_tokens=num_computed, num_tokens=num_tokens,
                              block_hashes=[0] * num_hashes)
    return manager, request


@given(st.integers(0, 6), st.integers(0, 40), st.integers(-1, 5), st.integers(1, 48),
       st.sampled_from([1, 4, 16]), st.sampled_from([4, 16]), st.integers(0, 6),
       st.integers(0, 8), st.integers(0, 48), st.integers(0, 2), st.integers(0, 3),
       st.booleans(), st.booleans(), st.booleans(), st.booleans(), st.booleans(),
       st.integers(0, 4))
def test_compiled_matches_twin(num_blocks, num_computed, num_new, max_model_len, block_size,
                               hash_block_size, num_cached, num_hashes, num_tokens,
                               reprefillable, free, caching, cacheable, running, has_blocks,
                               partial_hit, reserved):
    manager, request = _stand_in(num_blocks, num_computed, num_new, max_model_len, block_size,
                                 hash_block_size, num_cached, num_hashes, num_tokens,
                                 reprefillable, free, caching, cacheable, running,
                                 has_blocks, partial_hit)
    expected = _reference.allocate_slots_is_noop(manager, request, num_new, reserved, KINDS)
    assert _kernels.allocate_slots_is_noop(manager, request, num_new, reserved,
                                           KINDS) is expected


@pytest.mark.parametrize("implementation", [_kernels, _reference], ids=["compiled", "twin"])
def test_bad_input(implementation):
    manager, request = _stand_in(1, 3, 1, 64, 4, 4, 1, 1, 4, 0, 3, True, True, True, True,
                                 False)
    assert implementation.allocate_slots_is_noop(manager, request, 1, 0, KINDS) is True
    with pytest.raises(ValueError, match="kinds must have 4 items"):
        implementation.allocate_slots_is_noop(manager, request, 1, 0, KINDS[:3])
    with pytest.raises(TypeError):
        implementation.allocate_slots_is_noop(manager, request, 1, 0, list(KINDS))
    # Anything not exactly vLLM's plain kinds, or not an int: not a no-op (stock runs).
    assert implementation.allocate_slots_is_noop(object(), request, 1, 0, KINDS) is False
    assert implementation.allocate_slots_is_noop(manager, request, 1.0, 0, KINDS) is False
    assert implementation.allocate_slots_is_noop(manager, request, True, 0, KINDS) is False


def test_no_leaks():
    manager, request = _stand_in(1, 3, 1, 64, 4, 4, 1, 1, 4, 0, 3, True, True, True, True,
                                 False)
    for _ in range(100):
        _kernels.allocate_slots_is_noop(manager, request, 1, 0, KINDS)
    assert_no_leak(lambda: _kernels.allocate_slots_is_noop(manager, request, 1, 0, KINDS),
                   [manager, request, KINDS], 2000)


def test_guard_accepts_this_vllm_and_refuses_a_changed_method():
    import vllm

    assert patch.check_target(vllm.__version__, STOCK) is None
    assert "not a verified variant" in patch.check_target(vllm.__version__, make_fast)
    assert "not a verified version" in patch.check_target("0.34.0", STOCK)
    assert patch.overridden_methods() == []


def test_activation_check_passes_and_refuses_a_wrong_kernel(monkeypatch):
    assert patch.activation_check(STOCK, patch.allocate_slots) is None
    monkeypatch.setattr(fastbatch, "allocate_slots_is_noop", lambda *args: True)
    assert patch.activation_check(STOCK, patch.allocate_slots) is not None


def test_plugin_applies_and_reverts(monkeypatch):
    monkeypatch.setenv("FASTBATCH", "1")
    monkeypatch.setenv("FASTBATCH_DISABLE", "output spec penalties")
    try:
        vllm_plugin.register()
        assert patch.is_applied() and KVCacheManager.allocate_slots is patch.allocate_slots
        assert vllm_plugin.status()["patches"]["scheduler"] is True
    finally:
        patch.revert()
    assert KVCacheManager.allocate_slots is STOCK
    monkeypatch.setenv("FASTBATCH_DISABLE", "scheduler")
    vllm_plugin.register()
    assert KVCacheManager.allocate_slots is STOCK
    for module in vllm_plugin.PATCHES.values():
        importlib.import_module(module).revert()
