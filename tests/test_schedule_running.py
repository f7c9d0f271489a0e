"""Piece ``schedule_running``: ``Scheduler.schedule``'s running-request loop, compiled.

Against the REAL vLLM 0.33.0 scheduler (tox -e vllm), no model: the lockstep
harness (``scheduler_lockstep``) drives a stock scheduler and one whose
``schedule`` is fastbatch's (vLLM's own method compiled from its source with
the compiled loop's call added before vLLM's loop), with the same requests
and model outputs, and compares scheduler outputs, engine-core outputs, the
whole KV-cache state and every request after every step, over every plain
and spec-decoding workload (async placeholders at ``max_tokens``, chunked
prefills, preemption, arrivals, block boundaries, lookahead slots, drafts
verified in part, Model Runner V2's branches); with ``allocate_slots``' own
method on the manager (the planned calls made directly) and with vLLM's
(called as vLLM calls it), and with the pure-Python twin.
``FASTBATCH_LOCKSTEP_STEPS`` sets the total number of steps (default 2,000).

Also: the source transform and vLLM's loop taken from the source; compiled vs
twin on real requests; the hand-over at a request the loop does not follow;
profiling scopes on; the guard, the activation check (it refuses a planted
bug), bad input, leaks; the plugin; ``FASTBATCH_VERIFY`` (no false divergence
in lockstep, a planted bug caught and vLLM's loop's result in place).
"""

from __future__ import annotations

import array
import contextlib
import logging
import os
from types import MethodType

import pytest
import scheduler_lockstep as lockstep
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

import fastbatch
from fastbatch import _kernels, _reference, registry
from fastbatch._kernels import schedule_running as compiled_piece
from fastbatch._reference import schedule_running as twin_piece
from fastbatch.patches import _stand_ins, allocate_slots
from fastbatch.patches import schedule_running as patch
from leaks import assert_no_leak

pytestmark = pytest.mark.vllm
PIECE = registry.piece("schedule_running")
STOCK = Scheduler.schedule
TOTAL_STEPS = int(os.environ.get("FASTBATCH_LOCKSTEP_STEPS", "2000"))
ALL_WORKLOADS = lockstep.WORKLOADS + lockstep.SPEC_WORKLOADS
STEPS_PER_WORKLOAD = max(1, TOTAL_STEPS // len(ALL_WORKLOADS))  # TOTAL_STEPS a run
IDLE = {"requests": 0, "skipped": 0, "handed_over": 0}


@pytest.fixture(autouse=True)
def _bound_to_vllm():
    """The piece built from vLLM's own method (and allocate_slots' plan bound)."""
    patch.bind(STOCK)
    allocate_slots.bind()
    with _profiling_scopes_set():
        yield
    patch.bind(STOCK)
    allocate_slots.bind()


@contextlib.contextmanager
def _profiling_scopes_set():
    """vLLM's profiling switch as a first ``record_function_or_nullcontext``
    call leaves it (nullcontext: no profiler)."""
    from vllm.v1 import utils

    utils.record_function_or_nullcontext("fastbatch test")
    yield


def make_fast(workload, piece=compiled_piece, allocate=True):
    """A scheduler whose own ``schedule`` is fastbatch's with ``piece`` (the
    class stays stock); with ``allocate``, its KV manager's ``allocate_slots``
    the compiled piece's (the planned calls are then made directly)."""
    scheduler = lockstep.make_scheduler(workload)
    if piece is compiled_piece:
        scheduler.schedule = MethodType(patch.schedule, scheduler)
    else:
        built = patch.transformed(STOCK, lambda self, *arguments: piece.schedule_running_requests(
            self, *arguments,
            (patch._KINDS[0], _reference.allocate_slots.allocate_slots, *patch._KINDS[2:])))
        scheduler.schedule = MethodType(built, scheduler)
    if allocate:
        manager = scheduler.kv_cache_manager
        allocate_piece = (allocate_slots.allocate_slots if piece is compiled_piece
                          else _reference.allocate_slots.allocate_slots)
        if piece is not compiled_piece:
            _reference.allocate_slots.bind(STOCK_ALLOCATE, allocate_slots.kinds())
        manager.allocate_slots = MethodType(allocate_piece, manager)
    return scheduler


def _reset():
    _kernels.reset_stats()
    _reference.reset_stats()


@pytest.mark.parametrize("workload", ALL_WORKLOADS, ids=lambda w: w.name)
def test_lockstep_fast_loop_matches_stock(workload):
    _reset()
    harness = lockstep.Lockstep(workload, seed=17, make_fast=make_fast)
    harness.run(STEPS_PER_WORKLOAD)  # raises Divergence at the first difference
    counters = fastbatch.stats()["schedule_running"]
    assert counters["requests"] > 0  # the compiled loop scheduled requests
    assert fastbatch.stats()["allocate_slots"]["noop_allocations"] > 0
    assert twin_piece.stats() == IDLE
    if workload.name.endswith("preemption"):
        assert harness.preemptions > 0


@pytest.mark.parametrize("workload", [lockstep.WORKLOADS[1], lockstep.SPEC_WORKLOADS[-1]],
                         ids=lambda w: w.name)
def test_lockstep_with_vllms_allocate_slots(workload):
    """``allocate_slots`` left stock: the loop calls vLLM's method, as vLLM's
    loop does, for the calls the plan takes."""
    _reset()
    lockstep.Lockstep(workload, seed=4,
                      make_fast=lambda w: make_fast(w, allocate=False)).run(STEPS_PER_WORKLOAD)
    assert fastbatch.stats()["schedule_running"]["requests"] > 0
    allocations = fastbatch.stats()["allocate_slots"]
    assert allocations["noop_allocations"] == allocations["direct_allocations"] == 0


# Where each scheduler piece sits on a scheduler made fast by
# ``make_fast_with_every_scheduler_piece`` (an instance attribute; on the KV
# manager for allocate_slots): deleting it puts the class's (vLLM's) back.
_PIECE_ATTRIBUTES = {"after_schedule": ("scheduler", "_update_after_schedule"),
                     "allocate_slots": ("manager", "allocate_slots"),
                     "cached_requests": ("scheduler", "_make_cached_request_data"),
                     "schedule_running": ("scheduler", "schedule"),
                     "update_from_output": ("scheduler", "update_from_output")}


def _guard_accepts(name):
    """Whether every patch of piece ``name`` is a verified target on this
    vLLM (release and fingerprints), as ``FASTBATCH=1`` requires to install it."""
    import vllm

    return all(each.check_target(vllm.__version__, each.original() or each.current()) is None
               for each in registry.piece(name).patches)


def make_fast_as_fastbatch_leaves_it(workload):
    """As ``FASTBATCH=1`` leaves a scheduler: every scheduler piece that this
    vLLM is a verified target of (all five on vLLM 0.32.0 and 0.33.0), the
    others left vLLM's."""
    from test_update_from_output import make_fast_with_every_scheduler_piece

    scheduler = make_fast_with_every_scheduler_piece(workload)
    for name, (owner, attribute) in _PIECE_ATTRIBUTES.items():
        if not _guard_accepts(name):
            delattr(scheduler.kv_cache_manager if owner == "manager" else scheduler, attribute)
    return scheduler


@pytest.mark.parametrize("workload", ALL_WORKLOADS, ids=lambda w: w.name)
def test_lockstep_with_every_scheduler_piece(workload):
    """As ``FASTBATCH=1`` leaves a scheduler: the five scheduler pieces, where
    this vLLM is a verified target of each.  The suite's one lockstep run of
    them together, over every plain and spec-decoding workload: each piece
    that is installed took requests, those that are not stayed idle, and no
    twin ran."""
    assert _guard_accepts("schedule_running") and _guard_accepts("allocate_slots")
    _reset()
    lockstep.Lockstep(workload, seed=8,
                      make_fast=make_fast_as_fastbatch_leaves_it).run(STEPS_PER_WORKLOAD)
    stats = fastbatch.stats()
    assert stats["schedule_running"]["requests"] > 0
    allocations = stats["allocate_slots"]
    assert allocations["noop_allocations"] > 0
    if workload.num_spec_tokens:  # and left some to vLLM
        assert allocations["stock_allocations"] > 0
    for name, counter in (("update_from_output", "fast_outputs"),
                          ("after_schedule", "requests"), ("cached_requests", "requests")):
        if _guard_accepts(name):
            assert stats[name][counter] > 0, (name, counter)
        else:
            assert not any(stats[name].values()), name
    twins = _reference.stats()
    assert not any(any(twins[name].values()) for name in _PIECE_ATTRIBUTES), twins


def test_every_scheduler_piece_is_a_verified_target_where_token_ids_are_lists():
    """The lockstep above runs all five pieces together on every release
    whose requests hold their token ids in lists (before vLLM 0.34.0's
    TokenBuffer); on 0.34.0 at least this piece and allocate_slots."""
    accepted = {name: _guard_accepts(name) for name in _PIECE_ATTRIBUTES}
    assert accepted["schedule_running"] and accepted["allocate_slots"]
    if patch.token_store() is list:
        assert all(accepted.values()), accepted


def test_lockstep_with_the_pure_python_twin():
    _reset()
    for workload in (lockstep.WORKLOADS[3], lockstep.SPEC_WORKLOADS[-2]):
        lockstep.Lockstep(workload, seed=5,
                          make_fast=lambda w: make_fast(w, twin_piece)).run(60)
    assert twin_piece.stats()["requests"] > 0
    assert compiled_piece.stats() == IDLE


# allocate_slots answering None for a running request (issue 52) ----------------

def _refusing(harness, inner, calls):
    """An ``allocate_slots`` that returns None for some running requests (one
    in five, by request and step: the same on both sides of the lockstep) and
    otherwise answers as ``inner``; each call recorded in ``calls``."""
    from vllm.v1.request import RequestStatus

    def allocate_slots(request, num_new_tokens, *args, **kwargs):
        calls.append((harness.steps, request.request_id, num_new_tokens, len(args),
                      tuple(sorted((name, value) for name, value in kwargs.items()
                                   if type(value) in (int, bool)))))
        if (request.status == RequestStatus.RUNNING
                and (harness.steps + int(request.request_id[1:])) % 5 == 0):
            return None
        return inner(request, num_new_tokens, *args, **kwargs)

    return allocate_slots


@pytest.mark.parametrize("how", ["instance-function", "bound-wrapper", "mock"])
@pytest.mark.parametrize("workload", [lockstep.WORKLOADS[1], lockstep.SPEC_WORKLOADS[0]],
                         ids=lambda w: w.name)
def test_allocate_slots_of_another_kind_returning_none_is_vllms(workload, how):
    """A KV manager whose ``allocate_slots`` is neither fastbatch's nor vLLM's
    own (a wrapper, another plugin, a mock) and returns None for running
    requests: the schedule is stock's (it stalls or preempts them), with the
    same calls, never a request scheduled with None blocks; the compiled loop
    leaves every call to vLLM's loop."""
    from unittest import mock

    _reset()
    harness = lockstep.Lockstep(workload, seed=23, make_fast=make_fast)
    calls = {"stock": [], "fast": []}
    for side in ("stock", "fast"):
        manager = getattr(harness, side).kv_cache_manager
        wrapper = _refusing(harness, manager.allocate_slots, calls[side])
        if how == "instance-function":
            manager.allocate_slots = wrapper
        elif how == "bound-wrapper":
            manager.allocate_slots = MethodType(
                lambda self, *args, wrapper=wrapper, **kwargs: wrapper(*args, **kwargs), manager)
        else:
            manager.allocate_slots = mock.Mock(side_effect=wrapper)
    harness.run(150)  # raises Divergence at the first difference
    assert calls["fast"] == calls["stock"]
    assert harness.preemptions > 0  # the None answers were acted on, as stock does
    assert compiled_piece.stats()["requests"] == 0


def test_trusted_allocate_slots_returning_none_is_vllms(monkeypatch):
    """vLLM's own ``allocate_slots`` (here a stand-in in its place among the
    trusted functions, the compiled loop calling it after its plan) returns
    None for a running request: the compiled loop hands the request to
    vLLM's loop, which asks again and stalls or preempts as stock; the
    requests before it are the compiled loop's."""
    _reset()
    workload = lockstep.WORKLOADS[1]
    harness = lockstep.Lockstep(workload, seed=29,
                                make_fast=lambda w: make_fast(w, allocate=False))
    calls = {"stock": [], "fast": []}
    functions = {}
    for side in ("stock", "fast"):
        manager = getattr(harness, side).kv_cache_manager
        wrapper = _refusing(harness, manager.allocate_slots, calls[side])
        functions[side] = lambda self, *args, wrapper=wrapper, **kwargs: wrapper(*args, **kwargs)
        manager.allocate_slots = MethodType(functions[side], manager)
    monkeypatch.setattr(patch, "_KINDS", (*patch._KINDS[:3], (functions["fast"],)))
    harness.run(150)  # raises Divergence at the first difference
    assert harness.preemptions > 0
    assert compiled_piece.stats()["requests"] > 0
    assert compiled_piece.stats()["handed_over"] > 0
    # Every refused call was made again by vLLM's loop (the same answer: None).
    refused = [call for call in calls["fast"]
               if (call[0] + int(call[1][1:])) % 5 == 0]
    assert refused and len(calls["fast"]) > len(calls["stock"])


def test_allocate_slots_checked_by_fastbatch_verify_is_called(monkeypatch, tmp_path):
    """``allocate_slots`` checked by ``FASTBATCH_VERIFY`` (fastbatch's shadow
    wrapper of the compiled method, every call checked): the compiled loop
    calls it as vLLM's loop does and takes requests; the schedule is stock's."""
    from fastbatch import _verify

    monkeypatch.setenv("FASTBATCH_VERIFY_DIR", str(tmp_path))
    main = allocate_slots.PATCH
    for name, value in (("checked", 0), ("divergences", 0), ("reproducers", [])):
        monkeypatch.setattr(main, name, value)
    checked = _verify.checked_replacement(main, STOCK_ALLOCATE, 1.0)
    assert checked.__fastbatch__ is True

    def make_checked(workload):
        scheduler = make_fast(workload, allocate=False)
        manager = scheduler.kv_cache_manager
        manager.allocate_slots = MethodType(checked, manager)
        return scheduler

    _reset()
    lockstep.Lockstep(lockstep.SPEC_WORKLOADS[-1], seed=6, make_fast=make_checked).run(60)
    assert compiled_piece.stats()["requests"] > 0
    assert main.checked > 0 and main.divergences == 0


def test_allocate_slots_binding_decided_at_bind():
    """The kinds the patch binds: vLLM's own ``allocate_slots`` trusted where
    its fingerprint is verified, the release's token store."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    request_type, kernel, store, trusted = patch._KINDS
    assert request_type is Request and kernel is allocate_slots.allocate_slots
    assert trusted == (allocate_slots.PATCH.original() or KVCacheManager.allocate_slots,)
    probe = _stand_ins.scheduled_request("probe", 4, 1, 0, block_size=patch._BLOCK_SIZE)
    assert type(probe._all_token_ids) in (list, store)


def test_a_wrapper_in_vllms_place_is_not_trusted(monkeypatch):
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    stock = KVCacheManager.allocate_slots

    def wrapped(self, *args, **kwargs):
        return stock(self, *args, **kwargs)

    monkeypatch.setattr(KVCacheManager, "allocate_slots", wrapped)
    assert patch.verified_allocate_slots() == ()


# What vLLM's loop reads only on some paths -------------------------------------

@pytest.mark.parametrize("piece", [compiled_piece, twin_piece], ids=["compiled", "twin"])
@pytest.mark.parametrize("attribute", ["ec_connector", "need_mamba_block_aligned_split",
                                       "max_model_len", "num_sampled_tokens_per_step",
                                       "num_prefill_lookahead", "num_lookahead_tokens",
                                       "kv_cache_manager"])
def test_a_scheduler_without_what_the_loop_does_not_read_is_served(piece, attribute):
    """Every running request waits for a later step (``next_decode_eligible_step``):
    vLLM's loop then reads none of these; a scheduler without one (built
    without ``__init__``, as vLLM's own tests do) is served as stock serves it,
    the loop left to vLLM's, no AttributeError."""
    scheduler, state = _scheduler_and_state()
    for request in scheduler.running:
        request.next_decode_eligible_step = 99
    delattr(scheduler, attribute)
    arguments = _arguments(state)
    result = piece.schedule_running_requests(scheduler, *arguments, patch._KINDS)
    assert result == (0, 400, 440, False, False)
    reads = dict(zip(patch.LOOP_ARGUMENTS, arguments, strict=True), drafts_needed=False)
    stock = patch._VLLM_LOOP(scheduler, **{name: reads.get(name)
                                            for name in patch._VLLM_LOOP.reads})
    assert stock["req_index"] == len(scheduler.running) and arguments[8:] == ([], {}, {}, {})


@pytest.mark.parametrize("piece", [compiled_piece, twin_piece], ids=["compiled", "twin"])
def test_a_loop_that_does_not_start_reads_nothing(piece):
    scheduler = Scheduler.__new__(Scheduler)
    scheduler.running = []
    arguments = (0, 400, 440, 0, 0, False, False, False, [], {}, {}, {})
    assert piece.schedule_running_requests(scheduler, *arguments, patch._KINDS) == (
        0, 400, 440, False, False)
    scheduler.running = [object()]
    arguments = (0, 0, 440, 0, 0, False, False, False, [], {}, {}, {})  # no token budget
    assert piece.schedule_running_requests(scheduler, *arguments, patch._KINDS) == (
        0, 0, 440, False, False)


# Token stores: lists, vLLM 0.34.0's TokenBuffer, any array('i') bound ----------

class _LocalTokens(array.array):
    """An ``array('i')`` subclass like vLLM 0.34.0's ``TokenBuffer``."""

    __slots__ = ()

    def __new__(cls, tokens=()):
        return super().__new__(cls, "i", tokens)


@pytest.mark.parametrize("piece", [compiled_piece, twin_piece], ids=["compiled", "twin"])
def test_token_ids_in_an_array_bound_as_the_token_store(piece):
    """Requests whose token ids are an ``array('i')`` subclass bound as the
    token store (as vLLM 0.34.0's TokenBuffer is): the loop reads their
    length as vLLM's ``num_tokens`` does, and leaves the same state as
    vLLM's loop; a store of another type hands the request to vLLM's loop."""
    has_drafts = "drafts_needed" in patch._VLLM_LOOP.reads
    kinds = (patch._KINDS[0], patch._KINDS[1], _LocalTokens, patch._KINDS[3])
    states = []
    for function in (None, piece.schedule_running_requests):
        scheduler, state = patch._small_scheduler(Scheduler, allocate_slots.allocate_slots,
                                                  lookahead=3, prefill_lookahead=2,
                                                  budget=400)
        for request in scheduler.running:
            request._all_token_ids = _LocalTokens(request._all_token_ids)
        before = piece.stats()["requests"]
        bound = None if function is None else (
            lambda *args, function=function: function(*args[:-1], kinds))
        states.append(patch.run_loops(bound, scheduler, state, has_drafts))
        if function is not None:
            assert piece.stats()["requests"] - before > 5
    assert states[1] == states[0]
    scheduler, state = _scheduler_and_state()
    for request in scheduler.running:
        request._all_token_ids = list(request._all_token_ids)
    scheduler.running[1]._all_token_ids = _LocalTokens(scheduler.running[1]._all_token_ids)
    arguments = _arguments(state)
    index, *_ = piece.schedule_running_requests(
        scheduler, *arguments, (*patch._KINDS[:2], bytearray, patch._KINDS[3]))
    assert index == 1 and [request.request_id for request in arguments[8]] == ["decode"]


def test_activation_check_refuses_a_kernel_that_hands_every_request_back(monkeypatch):
    def hands_back(scheduler, req_index, token_budget, input_budget, draft_slots, threshold,
                   defer, prefill_scheduled, drafts_needed, *rest):
        return req_index, token_budget, input_budget, prefill_scheduled, drafts_needed

    monkeypatch.setattr(fastbatch, "schedule_running_requests", hands_back)
    problem = patch.activation_check(STOCK, patch.schedule)
    assert problem is not None and "scheduled no request itself" in problem


def test_activation_check_refuses_the_wrong_token_store(monkeypatch):
    """Bound to lists alone: where vLLM's requests hold a TokenBuffer (0.34.0)
    the kernel would hand every request back, and the check says so; where
    they hold lists, it passes."""
    monkeypatch.setattr(patch, "token_store", lambda: list)
    problem = patch.activation_check(STOCK, patch.schedule)
    probe = _stand_ins.scheduled_request("probe", 4, 1, 0, block_size=patch._BLOCK_SIZE)
    if type(probe._all_token_ids) is list:
        assert problem is None
    else:
        assert problem is not None and "scheduled no request itself" in problem


def test_activation_check_refuses_a_scheduler_attribute_vllms_loop_does_not_read(monkeypatch):
    monkeypatch.setattr(patch, "SCHEDULER_READ", (*patch.SCHEDULER_READ, "use_v2_model_runner"))
    problem = patch.activation_check(STOCK, patch.schedule)
    assert problem is not None and "use_v2_model_runner" in problem


def test_long_prefill_threshold_is_the_releases():
    """What ``schedule`` computes around the loop is vLLM's own code of this
    release: with chunked prefill off, vLLM 0.34.0 passes a threshold of 0
    (0.33.0 the configured one)."""
    import inspect

    workload = lockstep.WORKLOADS[8]  # chunked-prefill: threshold 24
    seen = []

    def helper(self, *arguments):
        seen.append(dict(zip(patch.LOOP_ARGUMENTS, arguments, strict=True)))
        return patch._unchanged(arguments)

    built = patch.transformed(STOCK, helper)
    for chunked in (True, False):
        scheduler = lockstep.make_scheduler(workload)
        scheduler.scheduler_config.enable_chunked_prefill = chunked
        for spec_id in ("a", "b"):
            scheduler.add_request(lockstep.make_request(lockstep.RequestSpec(
                request_id=spec_id, prompt=tuple(range(3, 40)), max_tokens=4, min_tokens=0,
                stop_token_ids=(), ignore_eos=False),
                workload.block_size))
        built(scheduler)
    needs_chunked = "enable_chunked_prefill and num_eligible_reqs" in inspect.getsource(STOCK)
    assert [each["long_prefill_token_threshold"] for each in seen] == [
        24, 0 if needs_chunked else 24]


def test_source_transform_adds_one_call_before_vllms_loop():
    import inspect

    built = patch.transformed(STOCK, lambda *args: None)
    assert built.__qualname__ == "Scheduler.schedule" and built.__doc__ == STOCK.__doc__
    assert built.__globals__ is vars(inspect.getmodule(STOCK))  # vLLM's names, live
    assert inspect.signature(built) == inspect.signature(STOCK)
    assert built.__code__.co_freevars == (patch._HELPER,)
    # vLLM's code at vLLM's lines (tracebacks point into vLLM's file).
    assert built.__code__.co_firstlineno == STOCK.__code__.co_firstlineno
    assert built.__code__.co_filename == STOCK.__code__.co_filename
    loop = patch.vllm_running_loop(STOCK)
    assert {"req_index", "token_budget", "input_budget", "draft_slots",
            "scheduled_running_reqs"} <= set(loop.reads)
    assert "drafts_needed" in loop.reads  # vLLM 0.33.0's loop

    def without_loop(self):
        req_index = 0
        while req_index < 3:
            req_index += 1

    with pytest.raises(ValueError, match="loops"):
        patch.transformed(without_loop, lambda *args: None)


def test_activation_check_passes_and_refuses_a_planted_bug(monkeypatch):
    assert patch.activation_check(STOCK, patch.schedule) is None

    real = compiled_piece.schedule_running_requests

    def one_budget_token_short(*args):
        index, budget, inputs, prefill, drafts = real(*args)
        return index, budget - 1, inputs, prefill, drafts

    monkeypatch.setattr(fastbatch, "schedule_running_requests", one_budget_token_short)
    problem = patch.activation_check(STOCK, patch.schedule)
    assert problem is not None and "fastbatch left" in problem


def test_activation_check_refuses_an_override(monkeypatch):
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    monkeypatch.setattr(AsyncScheduler, "_reserve_prefill_lookahead",
                        lambda self, request, computed, new: new, raising=False)
    problem = patch.activation_check(STOCK, patch.schedule)
    assert problem is not None and "overrides" in problem


@pytest.mark.parametrize("attribute", ["is_prefill_chunk", "spec_token_ids"])
def test_activation_check_refuses_an_attribute_the_instance_dict_would_bypass(monkeypatch,
                                                                              attribute):
    # The compiled loop reads a request's attributes through its instance
    # dict: a property of that name on Request (here one that takes what
    # __init__ sets) would be bypassed.
    monkeypatch.setattr(Request, attribute,
                        property(lambda request: None, lambda request, value: None),
                        raising=False)
    problem = patch.activation_check(STOCK, patch.schedule)
    assert problem is not None and f"['{attribute}'] would be bypassed" in problem


def _stock_compiled_and_twin_states(**settings):
    """The state vLLM's loop alone leaves, then the compiled loop's and the
    twin's, each followed by vLLM's loop, on ``patch._small_scheduler(**settings)``."""
    has_drafts = "drafts_needed" in patch._VLLM_LOOP.reads
    states = []
    for function, allocate in ((None, allocate_slots.PATCH.original() or STOCK_ALLOCATE),
                               (compiled_piece.schedule_running_requests,
                                allocate_slots.allocate_slots),
                               (twin_piece.schedule_running_requests,
                                allocate_slots.allocate_slots)):
        scheduler, state = patch._small_scheduler(Scheduler, allocate, **settings)
        states.append(patch.run_loops(function, scheduler, state, has_drafts))
    return states


@pytest.mark.parametrize("lookahead, prefill_lookahead, budget, defer",
                         [(0, 0, 400, False), (3, 2, 400, True), (3, 0, 21, False),
                          (1, 0, 5, True)])
def test_compiled_matches_twin_and_vllm(lookahead, prefill_lookahead, budget, defer):
    """The activation check's batches: vLLM's loop alone, then the compiled
    loop and the twin each followed by vLLM's loop, leave the same state."""
    states = _stock_compiled_and_twin_states(lookahead=lookahead,
                                             prefill_lookahead=prefill_lookahead,
                                             budget=budget, defer_prefills=defer)
    assert states[1] == states[0]
    assert states[2] == states[0]


# Ten copies of the activation check's batch, each request under its own id:
# longer than the compiled loop's prefetch pipeline (3 * PREFETCH_DISTANCE
# requests ahead), with every kind of request at every point of it.
_LONG_BATCH = tuple((f"{row[0]}-{copy}", *row[1:]) for copy in range(10) for row in patch._BATCH)


def test_batches_longer_than_the_prefetch_pipeline():
    """vLLM's loop alone, and the compiled loop and the twin each followed by
    vLLM's loop, leave the same state over a long batch."""
    states = _stock_compiled_and_twin_states(lookahead=0, prefill_lookahead=0, budget=4000,
                                             batch=_LONG_BATCH)
    assert states[1] == states[0]
    assert states[2] == states[0]
    assert len(states[1][1]) > 60  # most of the batch scheduled


def _scheduler_and_state(**settings):
    """The activation check's small scheduler, ``settings`` set on it; the twin's
    ``allocate_slots`` bound too (the twin loop plans with it), so that a test
    run alone finds it as a whole run does."""
    _reference.allocate_slots.bind(STOCK_ALLOCATE, allocate_slots.kinds())
    scheduler, state = patch._small_scheduler(Scheduler, allocate_slots.allocate_slots,
                                              lookahead=0, prefill_lookahead=0, budget=400)
    for name, value in settings.items():
        setattr(scheduler, name, value)
    return scheduler, state


def _arguments(state):
    return (*(state[name] for name in patch.LOOP_ARGUMENTS[:8]), [], {}, {}, {})


@pytest.mark.parametrize("piece", [compiled_piece, twin_piece], ids=["compiled", "twin"])
@pytest.mark.parametrize("odd", ["encoder", "no_attribute"])
def test_hands_over_at_a_request_it_does_not_follow(piece, odd):
    """A request with encoder inputs, or without an attribute the loop reads
    through its instance dict (the second): the loop returns at its index,
    nothing done for it; vLLM's loop goes on from there."""
    scheduler, state = _scheduler_and_state()
    if odd == "encoder":
        scheduler.running[1].mm_features = [object()]
    else:
        del scheduler.running[1].mm_features
    before = piece.stats()
    arguments = _arguments(state)
    index, *_ = piece.schedule_running_requests(scheduler, *arguments, patch._KINDS)
    assert index == 1
    assert [request.request_id for request in arguments[8]] == ["decode"]
    after = piece.stats()
    assert after["handed_over"] - before["handed_over"] == 1
    assert after["requests"] - before["requests"] == 1


@pytest.mark.parametrize("piece", [compiled_piece, twin_piece], ids=["compiled", "twin"])
@pytest.mark.parametrize("setting", [{"ec_connector": object()},
                                     {"need_mamba_block_aligned_split": True},
                                     {"running": tuple()}, {"current_step": 2**40}])
def test_leaves_the_whole_loop_to_vllm(piece, setting):
    scheduler, state = _scheduler_and_state(**setting)
    arguments = _arguments(state)
    result = piece.schedule_running_requests(scheduler, *arguments, patch._KINDS)
    assert result == (0, 400, 440, False, False)
    assert arguments[8:] == ([], {}, {}, {})


@pytest.mark.parametrize("piece", [compiled_piece, twin_piece], ids=["compiled", "twin"])
def test_bad_input(piece):
    scheduler, state = _scheduler_and_state()
    arguments = _arguments(state)
    with pytest.raises(TypeError, match="kinds must be a tuple"):
        piece.schedule_running_requests(scheduler, *arguments, list(patch._KINDS))
    for position, value in ((0, 1.0), (1, 2**40), (5, 1), (7, 0), (8, ()), (9, [])):
        bad = list(arguments)
        bad[position] = value
        result = piece.schedule_running_requests(scheduler, *bad, patch._KINDS)
        assert result == tuple(bad[i] for i in (0, 1, 2, 6, 7))  # unchanged: vLLM's loop
    assert arguments[8:] == ([], {}, {}, {})


def test_profiling_scopes_on_leave_vllms_loop_with_its_scopes(monkeypatch):
    from vllm.v1 import utils

    scopes = []

    @contextlib.contextmanager
    def recorded(name):
        scopes.append(name)
        yield

    monkeypatch.setattr(utils, "_PROFILER_FUNC", recorded)
    _reset()
    lockstep.Lockstep(lockstep.WORKLOADS[0], seed=2, make_fast=make_fast).run(20)
    assert compiled_piece.stats()["requests"] == 0
    assert "schedule: allocate_slots" in scopes


def test_no_leaks():
    scheduler, state = _scheduler_and_state()

    def call():
        for request in scheduler.running:
            request.spec_token_ids = []
        compiled_piece.schedule_running_requests(scheduler, *_arguments(state), patch._KINDS)

    for _ in range(20):
        call()
    # Each call allocates for the same requests again: nothing new once held.
    assert_no_leak(call, [scheduler], 200)


def test_no_leaks_over_a_batch_longer_than_the_prefetch_pipeline():
    _reference.allocate_slots.bind(STOCK_ALLOCATE, allocate_slots.kinds())
    scheduler, state = patch._small_scheduler(Scheduler, allocate_slots.allocate_slots,
                                              lookahead=0, prefill_lookahead=0, budget=4000,
                                              batch=_LONG_BATCH)
    state["input_budget"] = 4000

    def call():
        for request in scheduler.running:
            request.spec_token_ids = []
        index, *_ = compiled_piece.schedule_running_requests(scheduler, *_arguments(state),
                                                             patch._KINDS)
        assert index > 60

    for _ in range(20):
        call()
    # The prefetch holds each request and its instance dict for a while.
    assert_no_leak(call, [scheduler, *scheduler.running, *map(vars, scheduler.running)], 200)


def test_guard_accepts_this_vllm_and_refuses_a_changed_method():
    import vllm

    assert patch.PATCH.check_target(vllm.__version__, STOCK) is None

    def schedule(self, throttle_prefills=False):
        return None

    assert "not a verified variant" in patch.PATCH.check_target(vllm.__version__, schedule)


def test_plugin_applies_and_reverts():
    piece = registry.piece("schedule_running")
    assert piece.targets == ("vllm.v1.core.sched.scheduler.Scheduler.schedule",)
    try:
        assert piece.apply()
        assert Scheduler.schedule is patch.schedule
        assert piece.apply()  # idempotent
    finally:
        piece.revert()
    assert Scheduler.schedule is STOCK


# FASTBATCH_VERIFY ------------------------------------------------------------

@pytest.mark.parametrize("workload", [lockstep.WORKLOADS[1], lockstep.WORKLOADS[4],
                                      lockstep.SPEC_WORKLOADS[0], lockstep.SPEC_WORKLOADS[-1]],
                         ids=lambda w: w.name)
def test_verify_no_false_divergence_in_lockstep(checks_every_call, workload):
    _reset()
    lockstep.Lockstep(workload, seed=31, make_fast=make_fast).run(60)
    assert patch.PATCH.checked > 0 and compiled_piece.stats()["requests"] > 0
    assert patch.PATCH.divergences == 0 and patch.PATCH.reproducers == []


def test_verify_planted_bug_is_caught_and_vllms_loop_result_stands(checks_every_call, monkeypatch,
                                                                    logs):
    real = compiled_piece.schedule_running_requests

    def drops_the_drafts(*args):
        """The compiled loop, then the drafts it scheduled forgotten."""
        result = real(*args)
        args[12].clear()
        return result

    monkeypatch.setattr(fastbatch, "schedule_running_requests", drops_the_drafts)
    harness = lockstep.Lockstep(lockstep.SPEC_WORKLOADS[0], seed=3, make_fast=make_fast)
    # vLLM's loop's result is put in place: the lockstep sees no difference.
    while patch.PATCH.divergences == 0 and harness.steps < 200:
        harness.step()
    assert patch.PATCH.divergences == 1
    (path,) = patch.PATCH.reproducers
    assert os.path.dirname(path) == os.environ["FASTBATCH_VERIFY_DIR"]
    (error,) = [line for line in logs.at(logging.ERROR) if "FASTBATCH_VERIFY" in line]
    assert "'schedule_running'" in error
    harness.run(20)  # vLLM's schedule from now on
    # The reproducer is for reading: replaying it says so.
    assert "for reading" in patch.PATCH.replay({"locals": {}, "requests": []})


STOCK_ALLOCATE = allocate_slots.PATCH.original() or __import__(
    "vllm.v1.core.kv_cache_manager", fromlist=["KVCacheManager"]).KVCacheManager.allocate_slots
