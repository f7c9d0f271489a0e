"""Piece ``cached_requests``: ``Scheduler._make_cached_request_data`` with its loop compiled.

Against the REAL vLLM 0.33.0 scheduler (tox -e vllm): the lockstep harness
(``scheduler_lockstep``) drives a stock scheduler and one whose own instance
carries fastbatch's method, over every workload, and compares every field of
each ``SchedulerOutput`` (its ``CachedRequestData`` included, dicts in order)
after every step, and here also that each token-id copy is a list of its
own.  ``FASTBATCH_LOCKSTEP_STEPS`` sets the total number of steps (default
2,000).
Each lockstep run, with the compiled piece or its pure-Python twin, asserts
from that implementation's own counters that it took requests, and that
the other implementation's counters did not move.

Also: compiled vs twin vs vLLM's own method on generated batches of real
requests and KV-cache blocks (hypothesis); the pipeline-parallel branch runs
vLLM's method; bad input; the guard, the activation check, the plugin; leaks;
the installed method called by keyword, with and without verify.

vLLM's method has two shapes (``patch.SHAPES``): 0.30.0 to 0.33.0's, with
resumed requests and token-id copies, and 0.34.0's, running requests only.
The tests pick the installed one from vLLM's method and ``CachedRequestData``
(``SHAPE``), not from its version; the few that exist for one shape only
say so, and the other shape has its counterpart.
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import logging
import os
from types import MethodType, SimpleNamespace

import pytest
import scheduler_lockstep as lockstep
from hypothesis import given
from hypothesis import strategies as st
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import CachedRequestData
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request
from vllm.v1.utils import ConstantList

import fastbatch
from fastbatch import _kernels, _reference, registry, vllm_plugin
from fastbatch.patches import cached_requests as patch
from leaks import assert_no_leak

pytestmark = pytest.mark.vllm
STOCK = Scheduler._make_cached_request_data
KINDS = (Request, KVCacheBlocks, ConstantList)
SHAPE = patch.shape_of(STOCK, CachedRequestData)
RESUMED = SHAPE == patch.WITH_RESUMED  # 0.30.0-0.33.0: resumed requests, token-id copies
PARAMETERS = tuple(inspect.signature(STOCK).parameters)[1:]
TOTAL_STEPS = int(os.environ.get("FASTBATCH_LOCKSTEP_STEPS", "2000"))
STEPS_PER_WORKLOAD = max(1, TOTAL_STEPS // len(lockstep.WORKLOADS))


def make_fast(workload: lockstep.Workload):
    """A scheduler whose own instance runs fastbatch's method (the class stays
    stock, so the other scheduler in this process is untouched)."""
    scheduler = lockstep.make_scheduler(workload)
    fast = MethodType(patch._make_cached_request_data, scheduler)

    def checked(*args, **kwargs):
        data = fast(*args, **kwargs)
        arguments = inspect.signature(STOCK).bind(scheduler, *args, **kwargs).arguments
        tokens = [request._all_token_ids for name in ("running_reqs", "resumed_reqs")
                  for request in arguments.get(name, ())]
        for ids in patch._token_lists(data).values():  # copies, never the requests' own
            assert type(ids) is list and not any(ids is own for own in tokens)
        return data

    scheduler._make_cached_request_data = checked
    return scheduler


@pytest.mark.parametrize("workload", lockstep.WORKLOADS, ids=lambda w: w.name)
def test_lockstep_matches_stock(workload):
    _kernels.reset_stats()
    _reference.reset_stats()
    lockstep.Lockstep(workload, seed=33, make_fast=make_fast).run(STEPS_PER_WORKLOAD)
    assert fastbatch.stats()["cached_requests"]["requests"] > 0  # the compiled call took them
    assert _reference.cached_requests.stats() == {"requests": 0}  # the twin never ran


def test_lockstep_with_the_pure_python_twin(monkeypatch):
    monkeypatch.setattr(fastbatch, "cached_request_lists", _reference.cached_request_lists)
    _kernels.reset_stats()
    _reference.reset_stats()
    lockstep.Lockstep(lockstep.WORKLOADS[6], seed=8, make_fast=make_fast).run(60)
    assert _reference.cached_requests.stats()["requests"] > 0  # the twin took them
    assert _kernels.cached_requests.stats() == {"requests": 0}  # the compiled call never ran


# Generated batches of real requests -------------------------------------------

class _OtherBlocks(KVCacheBlocks):
    pass


_BLOCKS = st.lists(st.lists(st.integers(0, 99), max_size=3), min_size=1, max_size=2)
_REQUEST = st.tuples(st.integers(1, 20), st.integers(0, 4), st.integers(0, 300),
                     st.integers(0, 2), _BLOCKS, st.sampled_from(["plain", "tuple", "other"]))


def _batch(rows):
    requests, new_blocks = [], {}
    for index, (prompt, outputs, computed, placeholders, groups, kind) in enumerate(rows):
        request = Request(request_id=f"r{index}", prompt_token_ids=list(range(3, 3 + prompt)),
                          sampling_params=SamplingParams(max_tokens=64), pooling_params=None,
                          arrival_time=0.0)
        request.append_output_token_ids(list(range(10, 10 + outputs)))
        request.num_computed_tokens = computed
        request.num_output_placeholders = placeholders
        blocks = [[KVCacheBlock(block_id) for block_id in group] for group in groups]
        if kind == "tuple":
            new_blocks[request.request_id] = KVCacheBlocks(tuple(
                group or () for group in blocks))  # an empty group as vLLM's ()
        else:
            cls = _OtherBlocks if kind == "other" else KVCacheBlocks
            new_blocks[request.request_id] = cls(tuple(blocks))
        requests.append(request)
    return requests, new_blocks


def _scheduler(use_pp=False, async_scheduling=False, use_v2=False, previous=()):
    """A real ``Scheduler`` (no ``__init__``) with only what the installed
    method reads: on 0.34.0 no ``use_v2_model_runner`` and no
    ``prev_step_scheduled_req_ids`` (vLLM dropped them), so a replacement
    that read them would raise here."""
    scheduler = Scheduler.__new__(Scheduler)
    scheduler.use_pp = use_pp
    scheduler.scheduler_config = SimpleNamespace(async_scheduling=async_scheduling)
    if RESUMED:
        scheduler.use_v2_model_runner = use_v2
        scheduler.prev_step_scheduled_req_ids = set(previous)
    return scheduler


def _arguments(requests, num_running, num_scheduled_tokens, new_blocks):
    """The installed method's positional arguments: running and resumed
    requests (0.30.0-0.33.0), or all of them running (0.34.0)."""
    if RESUMED:
        return (requests[:num_running], requests[num_running:], num_scheduled_tokens, {},
                new_blocks)
    return (requests, num_scheduled_tokens, {}, new_blocks)


def _stock_compiled_and_twin(scheduler, *args):
    """The cached request data of vLLM's method, of fastbatch's with the
    compiled piece and with the twin, for the same arguments."""
    patch._bind()
    expected = patch.cached_request_state(STOCK(scheduler, *args))
    compiled = patch.cached_request_state(patch._make_cached_request_data(scheduler, *args))
    try:
        fastbatch.cached_request_lists = _reference.cached_request_lists
        twin = patch.cached_request_state(patch._make_cached_request_data(scheduler, *args))
    finally:
        fastbatch.cached_request_lists = _kernels.cached_request_lists
    return expected, compiled, twin


def test_the_installed_vllm_has_a_verified_shape():
    assert SHAPE in patch.SHAPES
    fields = tuple(field.name for field in dataclasses.fields(CachedRequestData))
    assert (("self", *PARAMETERS), fields) == patch.SHAPES[SHAPE]
    patch._bind()
    assert patch._SHAPE == SHAPE
    assert patch._IMPL is (patch._make_with_resumed if RESUMED else patch._make_running_only)


@given(st.lists(_REQUEST, max_size=6), st.integers(0, 6), st.booleans(), st.booleans(),
       st.booleans(), st.frozensets(st.integers(0, 6)))
def test_compiled_twin_and_vllm_agree(rows, num_running, use_v2, use_pp, async_scheduling,
                                      previous):
    requests, new_blocks = _batch(rows)
    scheduler = _scheduler(use_pp, async_scheduling, use_v2, {f"r{i}" for i in previous})
    scheduled = {request.request_id: 1 for request in requests}
    _kernels.reset_stats()
    _reference.reset_stats()
    expected, compiled, twin = _stock_compiled_and_twin(
        scheduler, *_arguments(requests, num_running, scheduled, new_blocks))
    assert compiled == expected
    assert twin == expected
    # the PP branch without async scheduling is vLLM's method
    counted = 0 if use_pp and not async_scheduling else len(requests)
    assert _kernels.stats()["cached_requests"]["requests"] == counted
    assert _reference.stats()["cached_requests"]["requests"] == counted


class _SubRequest(Request):
    pass


def _long_batch():
    """100 requests, every 7th a ``Request`` subclass (the prefetch skips its
    dict): longer than the prefetch pipeline (3 * PREFETCH_DISTANCE ahead)."""
    rows = [(3 + index % 5, index % 3, 5 + index, index % 2, [[index]], "plain")
            for index in range(100)]
    requests, new_blocks = _batch(rows)
    for request in requests[::7]:
        request.__class__ = _SubRequest
    return requests, new_blocks


def test_batches_longer_than_the_prefetch_pipeline():
    requests, new_blocks = _long_batch()
    scheduler = _scheduler(previous={"r3", "r50"})
    expected, compiled, twin = _stock_compiled_and_twin(
        scheduler, *_arguments(requests, 70, {request.request_id: 1 for request in requests},
                               new_blocks))
    assert compiled == expected
    assert twin == expected


@pytest.mark.parametrize("implementation", [_kernels, _reference], ids=["compiled", "twin"])
def test_token_ids_copied_as_vllm_copies_them(implementation):
    """The compiled loop's token-id copies (sent before 0.34.0) of this vLLM's
    requests: ``all_token_ids.copy()``, whatever the store is (a list, or
    0.34.0's ``TokenBuffer``, whose ``copy()`` gives a list)."""
    requests, new_blocks = _batch([(4, 2, 5, 0, [[1]], "plain"), (3, 0, 3, 1, [[]], "plain"),
                                   (6, 1, 7, 0, [[2]], "other")])
    lists = implementation.cached_request_lists(requests[:2], requests[2:], new_blocks,
                                                {"r1"}, KINDS)
    expected = {request.request_id: request.all_token_ids.copy()
                for request in (requests[0], requests[2])}
    assert lists[2] == expected
    for request in (requests[0], requests[2]):
        ids = lists[2][request.request_id]
        assert type(ids) is type(expected[request.request_id])
        assert ids is not request._all_token_ids


# Bad input, leaks ----------------------------------------------------------------

@pytest.mark.parametrize("implementation", [_kernels, _reference], ids=["compiled", "twin"])
def test_bad_input(implementation):
    requests, new_blocks = _batch([(4, 1, 5, 0, [[1]], "plain"), (3, 0, 3, 1, [[]], "plain")])
    lists = implementation.cached_request_lists
    with pytest.raises(TypeError):
        lists(tuple(requests), [], new_blocks, None, KINDS)
    with pytest.raises(TypeError):
        lists(requests, [], list(new_blocks.items()), None, KINDS)
    with pytest.raises(TypeError, match="prev_step_scheduled_req_ids must be a set"):
        lists(requests, [], new_blocks, ["r0"], KINDS)
    with pytest.raises(ValueError, match="kinds must have 3 items"):
        lists(requests, [], new_blocks, None, KINDS[:2])
    with pytest.raises(KeyError, match="r1"):  # vLLM's error: no blocks for a request
        lists(requests, [], {"r0": new_blocks["r0"]}, None, KINDS)
    with pytest.raises(AttributeError):
        lists([object()], [], new_blocks, None, KINDS)


def test_no_leaks():
    requests, new_blocks = _batch([(4, 1, 5, 0, [[1, 2]], "plain"), (3, 0, 3, 1, [[]], "plain"),
                                   (5, 2, 600, 1, [[3], [4]], "other")])
    previous = {"r1"}

    def step():
        _kernels.cached_request_lists(requests[:2], requests[2:], new_blocks, previous, KINDS)

    for _ in range(50):
        step()
    gc.collect()
    assert_no_leak(step, [*requests, *new_blocks.values(), previous, KINDS], 2000)


def test_no_leaks_over_a_batch_longer_than_the_prefetch_pipeline():
    requests, new_blocks = _long_batch()
    previous = {"r1"}

    def step():
        _kernels.cached_request_lists(requests[:70], requests[70:], new_blocks, previous, KINDS)

    for _ in range(20):
        step()
    gc.collect()
    # The prefetch holds each request and its instance dict for a while.
    assert_no_leak(step, [*requests, *map(vars, requests), *new_blocks.values(), previous,
                          KINDS], 200)


# Guard, activation check, plugin ----------------------------------------------------

def test_guard_accepts_this_vllm_and_refuses_a_changed_method():
    import vllm

    assert patch.PATCH.check_target(vllm.__version__, STOCK) is None
    assert "not a verified variant" in patch.PATCH.check_target(vllm.__version__, make_fast)
    assert patch.PATCH.versions[0] == "0.30.0"  # the first release it accepts
    assert "not a verified version" in patch.PATCH.check_target("0.29.0", STOCK)


def test_activation_check_passes_and_refuses_a_wrong_kernel(monkeypatch):
    assert patch.activation_check(STOCK, patch._make_cached_request_data) is None

    def drops_empty_groups(running, resumed, new_blocks, previous, kinds):
        lists = _reference.cached_request_lists(running, resumed, new_blocks, previous, kinds)
        lists[3][:] = [ids and tuple(group for group in ids if group) for ids in lists[3]]
        return lists

    def skips_the_last_request(running, resumed, new_blocks, previous, kinds):
        lists = _reference.cached_request_lists(running, resumed, new_blocks, previous, kinds)
        for values in lists[:2] + lists[3:]:
            if isinstance(values, list) and values:
                values.pop()
        return lists

    for wrong, why in ((drops_empty_groups, "fastbatch gave"),
                       (skips_the_last_request, "fastbatch gave")):
        monkeypatch.setattr(fastbatch, "cached_request_lists", wrong)
        assert why in patch.activation_check(STOCK, patch._make_cached_request_data)


def test_activation_check_refuses_a_replacement_that_hands_requests_to_vllm():
    """vLLM's results alone do not pass: the compiled loop must have taken the
    requests (its counter)."""
    def stock_in_disguise(self, *args, **kwargs):
        return STOCK(self, *args, **kwargs)

    def compiled_then_stock(self, *args, **kwargs):
        patch._make_cached_request_data(self, *args, **kwargs)
        patch._make_cached_request_data(self, *args, **kwargs)  # twice: counted twice
        return STOCK(self, *args, **kwargs)

    assert "took 0 of the 5 requests" in patch.activation_check(STOCK, stock_in_disguise)
    assert "took 10 of the 5 requests" in patch.activation_check(STOCK, compiled_then_stock)


def test_activation_check_refuses_a_method_of_neither_shape():
    def with_resumed(self, running_reqs, resumed_reqs, num_scheduled_tokens,
                     spec_decode_tokens, req_to_new_blocks):
        raise AssertionError("not called")

    def running_only(self, running_reqs, num_scheduled_tokens, spec_decode_tokens,
                     req_to_new_blocks):
        raise AssertionError("not called")

    # the other release's method, with this release's CachedRequestData
    other = running_only if RESUMED else with_resumed
    try:
        assert "of neither verified shape" in patch.activation_check(
            other, patch._make_cached_request_data)
        assert patch._SHAPE is None
    finally:
        patch._bind()
    assert patch._SHAPE == SHAPE


@pytest.mark.skipif(not RESUMED, reason="0.34.0 sends no token lists (counterpart: "
                    "test_activation_check_refuses_a_replacement_reading_dropped_attributes)")
def test_activation_check_refuses_shared_token_lists(monkeypatch):
    def shares_token_lists(running, resumed, new_blocks, previous, kinds):
        lists = _reference.cached_request_lists(running, resumed, new_blocks, previous, kinds)
        for request in running + resumed:
            if request.request_id in lists[2]:
                lists[2][request.request_id] = request._all_token_ids
        return lists

    monkeypatch.setattr(fastbatch, "cached_request_lists", shares_token_lists)
    assert "own token list, not a copy" in patch.activation_check(
        STOCK, patch._make_cached_request_data)


@pytest.mark.skipif(RESUMED, reason="before 0.34.0 the scheduler has these attributes "
                    "(counterpart: test_activation_check_refuses_shared_token_lists)")
def test_activation_check_refuses_a_replacement_reading_dropped_attributes(logs, monkeypatch):
    """0.34.0's scheduler has no ``use_v2_model_runner``: the check's scheduler
    carries only what vLLM's method reads, so a replacement that reads what
    vLLM dropped fails there and stays uninstalled, even under force."""
    def reads_use_v2(self, *args, **kwargs):
        if self.use_v2_model_runner:
            pass
        return patch._make_cached_request_data(self, *args, **kwargs)

    with pytest.raises(AttributeError, match="use_v2_model_runner"):
        patch.activation_check(STOCK, reads_use_v2)
    patch.PATCH.revert()
    monkeypatch.setattr(patch.PATCH, "replacement", reads_use_v2)
    assert not patch.PATCH.apply(force=True)
    assert Scheduler._make_cached_request_data is STOCK
    assert any("the check raised AttributeError" in line for line in logs.at(logging.ERROR))


def test_plugin_applies_and_reverts(monkeypatch):
    piece = registry.piece("cached_requests")
    assert piece.patches == (patch.PATCH,)
    monkeypatch.setenv("FASTBATCH", "1")
    monkeypatch.setenv("FASTBATCH_DISABLE",
                       "async_output_token_ids async_spec_token_ids penalty_output_tokens")
    try:
        vllm_plugin.register()
        assert Scheduler._make_cached_request_data is patch._make_cached_request_data
        assert piece.is_applied() and vllm_plugin.status()["patches"]["cached_requests"]
        assert patch.PATCH.original() is STOCK
    finally:
        piece.revert()
    assert Scheduler._make_cached_request_data is STOCK
    assert not piece.is_applied()
    monkeypatch.setenv("FASTBATCH_DISABLE", "cached_requests")
    try:
        vllm_plugin.register()
        assert Scheduler._make_cached_request_data is STOCK
        assert vllm_plugin.status()["patches"]["cached_requests"] is False
    finally:
        vllm_plugin.revert()


@pytest.mark.parametrize("rate", [0.0, 1.0], ids=["installed", "verified"])
def test_installed_method_takes_keywords_as_vllm_does(rate, monkeypatch, tmp_path):
    """vLLM's callers, and vLLM's own tests (issue 52), may pass any argument
    by keyword: the installed method, checked by verify or not, takes them as
    vLLM's method does, and refuses what vLLM's refuses."""
    monkeypatch.setenv("FASTBATCH_VERIFY_DIR", str(tmp_path))
    requests, new_blocks = _batch([(4, 1, 5, 0, [[1, 2]], "plain"), (3, 0, 3, 1, [[]], "plain"),
                                   (5, 2, 600, 1, [[3], [4]], "other")])
    scheduler = _scheduler(previous={"r1"})
    arguments = dict(zip(PARAMETERS, _arguments(
        requests, 2, {request.request_id: 1 for request in requests}, new_blocks), strict=True))
    first, *rest = PARAMETERS
    calls = [((), arguments),  # all by keyword, as vLLM's test does
             ((arguments[first],), {name: arguments[name] for name in rest}),
             ((), dict(reversed(arguments.items())))]
    patch.PATCH.revert()
    assert patch.PATCH.apply(verify=rate)
    try:
        assert getattr(vars(Scheduler)["_make_cached_request_data"], "__fastbatch__", False)
        _kernels.reset_stats()
        _reference.reset_stats()
        for args, kwargs in calls:
            expected = patch.cached_request_state(STOCK(scheduler, *args, **kwargs))
            got = scheduler._make_cached_request_data(*args, **kwargs)
            assert patch.cached_request_state(got) == expected
        assert fastbatch.stats()["cached_requests"]["requests"] == len(calls) * len(requests)
        assert patch.PATCH.checked == (len(calls) if rate else 0)
        assert patch.PATCH.divergences == 0
        for args, kwargs in (((), {**arguments, "extra": 1}),
                             ((arguments[first],), arguments),
                             ((), {name: arguments[name] for name in rest})):
            with pytest.raises(TypeError):
                STOCK(scheduler, *args, **kwargs)
            with pytest.raises(TypeError):
                scheduler._make_cached_request_data(*args, **kwargs)
    finally:
        patch.PATCH.revert()
    assert Scheduler._make_cached_request_data is STOCK


# FASTBATCH_VERIFY: the shadow check ------------------------------------------
# The patch is applied on the class with verify on; its checked method is then
# bound on the fast side's own scheduler only, and the class put back to
# vLLM's method for the stock side.

REAL_KERNEL = fastbatch.cached_request_lists
VERIFY_STEPS = max(40, STEPS_PER_WORKLOAD // 2)


@pytest.fixture
def verified(monkeypatch, tmp_path):
    """``verified(rate)``: the piece applied with verify ``rate``; returns a
    ``make_fast`` that binds its checked method on the fast side only.
    Reproducers go to tmp_path.  Stock again afterwards."""
    monkeypatch.setenv("FASTBATCH_VERIFY_DIR", str(tmp_path))
    assert registry.piece("cached_requests").patches == (patch.PATCH,)  # names it
    patch.PATCH.revert()
    applied = []

    def apply(rate=1.0):
        assert patch.PATCH.apply(verify=rate)
        checked = vars(Scheduler)["_make_cached_request_data"]
        assert getattr(checked, "__fastbatch__", False)
        assert checked is not patch._make_cached_request_data
        Scheduler._make_cached_request_data = STOCK
        applied.append(checked)

        def make_fast_checked(workload):
            scheduler = lockstep.make_scheduler(workload)
            scheduler._make_cached_request_data = MethodType(checked, scheduler)
            return scheduler

        return make_fast_checked

    yield apply
    if applied:
        Scheduler._make_cached_request_data = applied[0]
    patch.PATCH.revert()
    assert Scheduler._make_cached_request_data is STOCK


@pytest.mark.parametrize("workload", lockstep.WORKLOADS, ids=lambda w: w.name)
def test_verify_no_false_divergence_in_lockstep(verified, workload):
    harness = lockstep.Lockstep(workload, seed=35, make_fast=verified(1.0))
    harness.run(VERIFY_STEPS)  # the fast side's outputs stay stock's, every step
    assert patch.PATCH.checked == VERIFY_STEPS  # one call per step, every one checked
    assert patch.PATCH.divergences == 0


def wrong_for_big_batches(calls):
    """The real kernel, then, for more than 5 requests (the activation check
    has 5), the last request's computed-token count plus one."""
    def kernel(running, resumed, new_blocks, previous, kinds):
        calls.append(len(running) + len(resumed))
        lists = REAL_KERNEL(running, resumed, new_blocks, previous, kinds)
        if len(running) + len(resumed) > 5:
            lists[4][-1] += 1
        return lists
    return kernel


def test_verify_planted_bug_is_caught_and_vllm_result_stands(verified, monkeypatch, logs):
    harness = lockstep.Lockstep(lockstep.WORKLOADS[0], seed=2, make_fast=verified(1.0))
    calls = []
    # planted after apply: the activation check passed on the real kernel
    monkeypatch.setattr(fastbatch, "cached_request_lists", wrong_for_big_batches(calls))
    # The lockstep compares every scheduler output: the fast side's stays stock's.
    while patch.PATCH.divergences == 0 and harness.steps < 200:
        harness.step()
    assert patch.PATCH.divergences == 1 and calls[-1] > 5
    (path,) = patch.PATCH.reproducers
    assert os.path.dirname(path) == os.environ["FASTBATCH_VERIFY_DIR"]
    (error,) = [line for line in logs.at(logging.ERROR) if "FASTBATCH_VERIFY" in line]
    assert "'cached_requests'" in error and "num_computed_tokens" in error
    # From now on vLLM's method runs: the kernel is not called.
    num_calls, checked = len(calls), patch.PATCH.checked
    harness.run(20)
    assert len(calls) == num_calls and patch.PATCH.checked == checked
    # The reproducer replays the divergence, and no longer once the bug is gone.
    assert "num_computed_tokens" in vllm_plugin.replay(path)
    monkeypatch.setattr(fastbatch, "cached_request_lists", REAL_KERNEL)
    assert vllm_plugin.replay(path) is None


@pytest.mark.skipif(not RESUMED, reason="0.34.0 sends no token lists (counterpart: "
                    "test_verify_a_divergence_in_a_keyword_call_returns_vllm_result)")
def test_verify_a_request_own_token_list_is_a_divergence(verified, monkeypatch):
    """Values alone are not enough: the token lists sent must be copies."""
    from fastbatch import _verify

    verified(1.0)

    def shares_token_lists(running, resumed, new_blocks, previous, kinds):
        lists = REAL_KERNEL(running, resumed, new_blocks, previous, kinds)
        for request in running + resumed:
            if request.request_id in lists[2]:
                lists[2][request.request_id] = request._all_token_ids
        return lists

    monkeypatch.setattr(fastbatch, "cached_request_lists", shares_token_lists)
    running, resumed, new_blocks = patch._small_batch()
    scheduler = _scheduler(previous={"r1", "r4"})
    expected = STOCK(scheduler, running, resumed, {}, {}, new_blocks)
    checked = _verify.checked_replacement(patch.PATCH, STOCK, 1.0)
    got = checked(scheduler, running, resumed, {}, {}, new_blocks)
    assert patch.PATCH.divergences == 1
    assert patch.cached_request_state(got) == patch.cached_request_state(expected)
    own = [request._all_token_ids for request in running + resumed]
    assert not any(ids is mine for ids in got.all_token_ids.values() for mine in own)


def test_verify_a_divergence_in_a_keyword_call_returns_vllm_result(verified, monkeypatch):
    from fastbatch import _verify

    verified(1.0)

    def one_output_token_more(running, resumed, new_blocks, previous, kinds):
        lists = REAL_KERNEL(running, resumed, new_blocks, previous, kinds)
        lists[5][0] += 1
        return lists

    monkeypatch.setattr(fastbatch, "cached_request_lists", one_output_token_more)
    running, resumed, new_blocks = patch._small_batch()
    requests = running + resumed
    scheduler = _scheduler(previous={"r1", "r4"})
    arguments = dict(zip(PARAMETERS, _arguments(requests, 3, {}, new_blocks), strict=True))
    expected = STOCK(scheduler, **arguments)
    checked = _verify.checked_replacement(patch.PATCH, STOCK, 1.0)
    got = checked(scheduler, **arguments)
    assert patch.PATCH.checked == 1 and patch.PATCH.divergences == 1
    assert type(got) is CachedRequestData
    assert patch.cached_request_state(got) == patch.cached_request_state(expected)
    # the divergence is replayed from its reproducer (requests and blocks as data)
    (path,) = patch.PATCH.reproducers
    assert "num_output_tokens" in vllm_plugin.replay(path)


def test_verify_sampled_rate_checks_some_calls(verified):
    from fastbatch import _verify

    verified(1.0)  # applied; the rate is forced below
    for rate, low, high in ((0.5, 1, 39), (1.0, 40, 40), (0.0, 0, 0)):
        patch.PATCH.checked = 0

        def make_fast_sampled(workload, rate=rate):
            scheduler = lockstep.make_scheduler(workload)
            scheduler._make_cached_request_data = MethodType(
                _verify.checked_replacement(patch.PATCH, STOCK, rate), scheduler)
            return scheduler

        lockstep.Lockstep(lockstep.WORKLOADS[0], seed=6, make_fast=make_fast_sampled).run(40)
        assert low <= patch.PATCH.checked <= high
        assert patch.PATCH.divergences == 0
