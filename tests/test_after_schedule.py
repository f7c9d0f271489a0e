"""Piece ``after_schedule``: ``Scheduler._update_after_schedule`` and
``AsyncScheduler._update_after_schedule`` with their loops compiled.

Against the REAL vLLM 0.33.0 scheduler (tox -e vllm): the lockstep harness
(``scheduler_lockstep``) drives a stock scheduler and one whose own instance
carries fastbatch's method, over every workload, and compares after every
step the scheduler outputs, engine-core outputs, KV-cache state and every
request, and here also what only this method touches (the in-flight
prefills, the cleared id sets, which requests share the step's spec-token
placeholder list, ``last_sched_seq``, ``next_decode_eligible_step``).
``FASTBATCH_LOCKSTEP_STEPS`` sets the total number of steps (default 2,000).
Each lockstep run, with the compiled piece or its pure-Python twin, asserts
from that implementation's own counters that it took requests, and that
the other implementation's counters did not move.

Also: compiled vs twin vs vLLM's own methods on generated batches of real
requests (hypothesis), including batches the kernel must hand back to vLLM;
bad input; the guard, the activation check, the plugin; leaks.
"""

from __future__ import annotations

import gc
import logging
import os
from types import MethodType, SimpleNamespace

import pytest
import scheduler_lockstep as lockstep
from hypothesis import given
from hypothesis import strategies as st
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

import fastbatch
from fastbatch import _kernels, _reference, registry, vllm_plugin
from fastbatch.patches import after_schedule as patch
from leaks import assert_no_leak

pytestmark = pytest.mark.vllm
STOCK = Scheduler._update_after_schedule
ASYNC_STOCK = AsyncScheduler._update_after_schedule
TOTAL_STEPS = int(os.environ.get("FASTBATCH_LOCKSTEP_STEPS", "2000"))
STEPS_PER_WORKLOAD = max(1, TOTAL_STEPS // len(lockstep.WORKLOADS))


def make_fast(workload: lockstep.Workload):
    """A scheduler whose own instance runs fastbatch's method (the classes
    stay stock, so the other scheduler in this process is untouched)."""
    scheduler = lockstep.make_scheduler(workload)
    replacement = (patch._update_after_schedule_async if workload.async_scheduling
                   else patch._update_after_schedule)
    scheduler._update_after_schedule = MethodType(replacement, scheduler)
    return scheduler


def own_state(scheduler):
    """What ``_update_after_schedule`` changes that the harness does not compare."""
    placeholders = getattr(scheduler, "_spec_token_placeholders", None)
    return {
        "inflight_prefills": sorted(r.request_id for r in scheduler._inflight_prefills),
        "finished_req_ids": sorted(scheduler.finished_req_ids),
        "reset_preempted_req_ids": sorted(scheduler.reset_preempted_req_ids),
        "spec_token_placeholders": placeholders,
        "requests": {rid: (r.last_sched_seq, r.next_decode_eligible_step,
                           type(r.num_computed_tokens), type(r.num_output_placeholders),
                           type(r.is_prefill_chunk), r.spec_token_ids is placeholders)
                     for rid, r in scheduler.requests.items()},
    }


class Lockstep(lockstep.Lockstep):
    def _compare_states(self):
        super()._compare_states()
        self._compare("after_schedule", own_state(self.stock), own_state(self.fast))


IDLE = {"requests": 0, "stock_calls": 0}


@pytest.mark.parametrize("workload", lockstep.WORKLOADS, ids=lambda w: w.name)
def test_lockstep_matches_stock(workload):
    _kernels.reset_stats()
    _reference.reset_stats()
    Lockstep(workload, seed=21, make_fast=make_fast).run(STEPS_PER_WORKLOAD)
    counters = fastbatch.stats()["after_schedule"]
    assert counters["requests"] > 0  # the compiled pass took the batches
    assert counters["stock_calls"] == 0  # vLLM's own batches are plain
    assert _reference.after_schedule.stats() == IDLE  # the twin never ran


@pytest.mark.parametrize("workload", [lockstep.WORKLOADS[2], lockstep.WORKLOADS[12]],
                         ids=lambda w: w.name)
def test_lockstep_with_the_pure_python_twin(monkeypatch, workload):
    monkeypatch.setattr(fastbatch, "update_after_schedule", _reference.update_after_schedule)
    _kernels.reset_stats()
    _reference.reset_stats()
    Lockstep(workload, seed=4, make_fast=make_fast).run(60)
    counters = _reference.after_schedule.stats()
    assert counters["requests"] > 0  # the twin took the batches
    assert counters["stock_calls"] == 0
    assert _kernels.after_schedule.stats() == IDLE  # the compiled pass never ran


# Generated batches of real requests -------------------------------------------

_REQUEST = st.tuples(st.integers(1, 40), st.integers(0, 5), st.integers(0, 50),
                     st.integers(0, 3), st.booleans(), st.integers(1, 20),
                     st.none() | st.lists(st.integers(0, 63), max_size=3), st.booleans())
# Ways to make a batch that the kernel must hand back to vLLM unchanged.
_ODD = st.sampled_from([None, "float_count", "missing", "wrong_id", "subclass", "flag_int",
                        "spec_tuple"])


class _OtherRequest(Request):
    pass


def _scheduler(cls, rows, defer, use_v2, odd):
    scheduler = cls.__new__(cls)
    scheduler.requests = {}
    output = SimpleNamespace(num_scheduled_tokens={}, scheduled_spec_decode_tokens={},
                             num_spec_tokens_to_schedule=len(rows) % 3,
                             has_structured_output_requests=False,
                             pending_structured_output_tokens=False)
    inflight = set()
    for index, (prompt, outputs, computed, placeholders, structured, scheduled, spec,
                in_flight) in enumerate(rows):
        kind = _OtherRequest if odd == "subclass" and index == 0 else Request
        request = kind(request_id=f"r{index}", prompt_token_ids=list(range(3, 3 + prompt)),
                       sampling_params=patch_sampling(), pooling_params=None,
                       arrival_time=0.0)
        request.append_output_token_ids(list(range(5, 5 + outputs)))
        request.num_computed_tokens = computed
        request.num_output_placeholders = request.num_in_flight_tokens = placeholders
        if structured:
            request.structured_output_request = SimpleNamespace()
        if in_flight:
            inflight.add(request)
        scheduler.requests[request.request_id] = request
        output.num_scheduled_tokens[request.request_id] = scheduled
        if spec is not None:
            output.scheduled_spec_decode_tokens[request.request_id] = spec
    scheduler._inflight_prefills = inflight
    scheduler.defer_block_free, scheduler.sched_step_seq = defer, 12345
    scheduler.finished_req_ids, scheduler.reset_preempted_req_ids = {"f"}, {"p"}
    scheduler.num_sampled_tokens_per_step, scheduler.use_v2_model_runner = 1, use_v2
    scheduler.current_step, scheduler.decode_stagger = 300, 1
    if rows and odd == "float_count":
        scheduler.requests["r0"].num_computed_tokens = 1.0
    elif rows and odd == "missing":
        del scheduler.requests["r0"]
    elif rows and odd == "wrong_id":
        scheduler.requests["r0"].request_id = "other"
    elif rows and odd == "no_attribute":  # read through the instance dict: not there
        del scheduler.requests[f"r{len(rows) - 1}"].structured_output_request
    elif odd == "flag_int":
        output.has_structured_output_requests = 0
    elif rows and odd == "spec_tuple":
        output.scheduled_spec_decode_tokens["r0"] = (1,)
    return scheduler, output


def patch_sampling():
    from vllm.sampling_params import SamplingParams

    return SamplingParams(max_tokens=64)


def _outcome(function, cls, rows, defer, use_v2, odd):
    scheduler, output = _scheduler(cls, rows, defer, use_v2, odd)
    try:
        function(scheduler, output)
    except Exception as exc:  # vLLM's own error, where the batch is broken
        raised = type(exc)
    else:
        raised = None
    return raised, patch.scheduler_state(scheduler, output)


@given(st.lists(_REQUEST, max_size=6), st.booleans(), st.booleans(), st.booleans(), _ODD)
def test_compiled_twin_and_vllm_agree(rows, is_async, defer, use_v2, odd):
    cls, stock, replacement = ((AsyncScheduler, ASYNC_STOCK, patch._update_after_schedule_async)
                               if is_async else
                               (Scheduler, STOCK, patch._update_after_schedule))
    patch._bind()
    expected = _outcome(stock, cls, rows, defer, use_v2, odd)
    _kernels.reset_stats()
    _reference.reset_stats()
    compiled = _outcome(replacement, cls, rows, defer, use_v2, odd)
    try:
        fastbatch.update_after_schedule = _reference.update_after_schedule
        twin = _outcome(replacement, cls, rows, defer, use_v2, odd)
    finally:
        fastbatch.update_after_schedule = _kernels.update_after_schedule
    assert compiled == expected
    assert twin == expected
    assert _kernels.stats()["after_schedule"] == _reference.stats()["after_schedule"]
    if odd in (None, "spec_tuple") and rows and not (odd == "spec_tuple" and is_async):
        assert _kernels.stats()["after_schedule"]["requests"] == len(rows)


# Bad input, leaks ----------------------------------------------------------------

_ROWS = [(8, 2, 9, 1, True, 1, [3], False), (30, 0, 0, 0, False, 16, None, True)]


@pytest.mark.parametrize("implementation", [_kernels, _reference], ids=["compiled", "twin"])
def test_bad_input(implementation):
    scheduler, output = _scheduler(AsyncScheduler, _ROWS, False, False, None)
    before = patch.scheduler_state(scheduler, output)
    with pytest.raises(TypeError, match="spec_token_placeholders must be a list or None"):
        implementation.update_after_schedule(scheduler, output, (-1,), Request)
    with pytest.raises(TypeError, match="request_type must be a class"):
        implementation.update_after_schedule(scheduler, output, None, "Request")
    with pytest.raises(AttributeError):
        implementation.update_after_schedule(object(), output, None, Request)
    assert patch.scheduler_state(scheduler, output) == before
    for odd in ("float_count", "missing", "wrong_id", "no_attribute", "subclass", "flag_int"):
        scheduler, output = _scheduler(AsyncScheduler, _ROWS, False, False, odd)
        before = patch.scheduler_state(scheduler, output)
        assert implementation.update_after_schedule(scheduler, output, [-1], Request) is False
        assert patch.scheduler_state(scheduler, output) == before, odd


def test_no_leaks():
    def step():
        scheduler, output = _scheduler(AsyncScheduler, _ROWS, True, True, None)
        _kernels.update_after_schedule(scheduler, output, [-1], Request)

    for _ in range(50):
        step()
    scheduler, output = _scheduler(AsyncScheduler, _ROWS, True, True, None)
    placeholders = [-1, -1]

    def again():
        # The same batch again and again (counters grow; nothing else should).
        _kernels.update_after_schedule(scheduler, output, placeholders, Request)

    for _ in range(3):  # until every request decodes and holds the placeholder list
        again()
    gc.collect()  # earlier tests' requests still hold the Request class
    assert_no_leak(again, [scheduler, output, placeholders, Request,
                           *scheduler.requests.values()], 2000)


# Guard, activation check, plugin ----------------------------------------------------

def test_guard_accepts_this_vllm_and_refuses_a_changed_method():
    import vllm

    assert patch.PATCH.check_target(vllm.__version__, STOCK) is None
    assert patch.ASYNC_PATCH.check_target(vllm.__version__, ASYNC_STOCK) is None
    assert "not a verified variant" in patch.PATCH.check_target(vllm.__version__, make_fast)
    assert "not a verified variant" in patch.ASYNC_PATCH.check_target(vllm.__version__, STOCK)
    assert "not a verified version" in patch.PATCH.check_target("0.30.0", STOCK)
    assert "not a verified version" in patch.ASYNC_PATCH.check_target("0.30.0", ASYNC_STOCK)


def test_activation_check_passes_and_refuses_a_wrong_kernel(monkeypatch):
    assert patch.activation_check(STOCK, patch._update_after_schedule) is None
    assert patch.async_activation_check(ASYNC_STOCK, patch._update_after_schedule_async) is None

    def off_by_one(scheduler, output, placeholders, request_type):
        done = _reference.update_after_schedule(scheduler, output, placeholders, request_type)
        for request in scheduler.requests.values():
            request.num_in_flight_tokens += 1
        return done

    def drops_placeholder_sharing(scheduler, output, placeholders, request_type):
        return _reference.update_after_schedule(
            scheduler, output, None if placeholders is None else list(placeholders),
            request_type)

    monkeypatch.setattr(fastbatch, "update_after_schedule", off_by_one)
    assert "fastbatch left" in patch.activation_check(STOCK, patch._update_after_schedule)
    monkeypatch.setattr(fastbatch, "update_after_schedule", drops_placeholder_sharing)
    assert "fastbatch left" in patch.async_activation_check(
        ASYNC_STOCK, patch._update_after_schedule_async)


@pytest.mark.parametrize("attribute", ["num_computed_tokens", "spec_token_ids"])
def test_activation_check_refuses_an_attribute_the_instance_dict_would_bypass(monkeypatch,
                                                                              attribute):
    # The compiled call reads and writes a request's attributes through its instance
    # dict: a property of that name on Request (here one that takes what
    # __init__ sets) would be bypassed.
    monkeypatch.setattr(Request, attribute,
                        property(lambda request: None, lambda request, value: None),
                        raising=False)
    for check, stock, replacement in (
            (patch.activation_check, STOCK, patch._update_after_schedule),
            (patch.async_activation_check, ASYNC_STOCK, patch._update_after_schedule_async)):
        assert f"['{attribute}'] would be bypassed" in check(stock, replacement)


def test_plugin_applies_and_reverts(monkeypatch):
    piece = registry.piece("after_schedule")
    assert piece.patches == (patch.ASYNC_PATCH, patch.PATCH)  # the async one first
    monkeypatch.setenv("FASTBATCH", "1")
    monkeypatch.setenv("FASTBATCH_DISABLE",
                       "async_output_token_ids async_spec_token_ids penalty_output_tokens")
    try:
        vllm_plugin.register()
        assert Scheduler._update_after_schedule is patch._update_after_schedule
        assert AsyncScheduler._update_after_schedule is patch._update_after_schedule_async
        assert piece.is_applied() and vllm_plugin.status()["patches"]["after_schedule"]
        assert patch.PATCH.is_applied() and patch.ASYNC_PATCH.is_applied()
    finally:
        piece.revert()
    assert Scheduler._update_after_schedule is STOCK
    assert AsyncScheduler._update_after_schedule is ASYNC_STOCK
    assert not piece.is_applied()
    monkeypatch.setenv("FASTBATCH_DISABLE", "after_schedule")
    try:
        vllm_plugin.register()
        assert Scheduler._update_after_schedule is STOCK
        assert AsyncScheduler._update_after_schedule is ASYNC_STOCK
        assert vllm_plugin.status()["patches"]["after_schedule"] is False
    finally:
        vllm_plugin.revert()


# FASTBATCH_VERIFY: the shadow checks ------------------------------------------
# Both patches are applied on the classes with verify on; their checked methods
# are then bound on the fast side's own scheduler only, and the classes put
# back to vLLM's methods for the stock side.

REAL_KERNEL = fastbatch.update_after_schedule
VERIFY_STEPS = max(40, STEPS_PER_WORKLOAD // 2)


@pytest.fixture
def verified(monkeypatch, tmp_path):
    """``verified(rate)``: the piece applied with verify ``rate``; returns a
    ``make_fast`` that binds the checked methods on the fast side only.
    Reproducers go to tmp_path.  Stock again afterwards."""
    monkeypatch.setenv("FASTBATCH_VERIFY_DIR", str(tmp_path))
    piece = registry.piece("after_schedule")
    piece.revert()
    applied = {}

    def apply(rate=1.0):
        assert all(one.apply(verify=rate) for one in piece.patches)
        applied.update({cls: vars(cls)["_update_after_schedule"]
                        for cls in (Scheduler, AsyncScheduler)})
        assert all(getattr(checked, "__fastbatch__", False) for checked in applied.values())
        assert applied[Scheduler] is not patch._update_after_schedule
        Scheduler._update_after_schedule = STOCK
        AsyncScheduler._update_after_schedule = ASYNC_STOCK

        def make_fast_checked(workload):
            scheduler = lockstep.make_scheduler(workload)
            checked = applied[AsyncScheduler if workload.async_scheduling else Scheduler]
            scheduler._update_after_schedule = MethodType(checked, scheduler)
            return scheduler

        return make_fast_checked

    yield apply
    for cls, checked in applied.items():
        cls._update_after_schedule = checked
    piece.revert()
    assert Scheduler._update_after_schedule is STOCK
    assert AsyncScheduler._update_after_schedule is ASYNC_STOCK


@pytest.mark.parametrize("workload", lockstep.WORKLOADS, ids=lambda w: w.name)
def test_verify_no_false_divergence_in_lockstep(verified, workload):
    harness = Lockstep(workload, seed=23, make_fast=verified(1.0))
    harness.run(VERIFY_STEPS)  # the fast side's state stays stock's, every step
    checked_patch, other = ((patch.ASYNC_PATCH, patch.PATCH) if workload.async_scheduling
                            else (patch.PATCH, patch.ASYNC_PATCH))
    assert checked_patch.checked == VERIFY_STEPS  # one call per step, every one checked
    assert other.checked == 0
    assert patch.PATCH.divergences == patch.ASYNC_PATCH.divergences == 0


def wrong_for_big_batches(calls):
    """The real kernel, then, for a batch of more than 6 requests (the
    activation check's has 6), the first request's computed tokens plus one."""
    def kernel(scheduler, output, placeholders, request_type):
        calls.append(len(output.num_scheduled_tokens))
        done = REAL_KERNEL(scheduler, output, placeholders, request_type)
        if done and len(output.num_scheduled_tokens) > 6:
            scheduler.requests[next(iter(output.num_scheduled_tokens))].num_computed_tokens += 1
        return done
    return kernel


@pytest.mark.parametrize("workload", [lockstep.WORKLOADS[0], lockstep.WORKLOADS[1]],
                         ids=lambda w: w.name)
def test_verify_planted_bug_is_caught_and_vllm_result_stands(verified, monkeypatch, logs,
                                                             workload):
    harness = Lockstep(workload, seed=2, make_fast=verified(1.0))
    checked_patch = patch.ASYNC_PATCH if workload.async_scheduling else patch.PATCH
    calls = []
    # planted after apply: the activation check passed on the real kernel
    monkeypatch.setattr(fastbatch, "update_after_schedule", wrong_for_big_batches(calls))
    # The lockstep compares every step: the fast side stays stock's.
    while checked_patch.divergences == 0 and harness.steps < 200:
        harness.step()
    assert checked_patch.divergences == 1 and calls[-1] > 6
    (path,) = checked_patch.reproducers
    assert os.path.dirname(path) == os.environ["FASTBATCH_VERIFY_DIR"]
    (error,) = [line for line in logs.at(logging.ERROR) if "FASTBATCH_VERIFY" in line]
    assert repr(checked_patch.name) in error and "num_computed_tokens" in error
    # From now on vLLM's method runs: the kernel is not called.
    num_calls, checked = len(calls), checked_patch.checked
    harness.run(20)
    assert len(calls) == num_calls and checked_patch.checked == checked
    # The reproducer replays the divergence, and no longer once the bug is gone.
    assert "num_computed_tokens" in vllm_plugin.replay(path)
    monkeypatch.setattr(fastbatch, "update_after_schedule", REAL_KERNEL)
    assert vllm_plugin.replay(path) is None


def test_verify_divergence_restores_every_field_in_the_live_objects(verified, monkeypatch):
    """One call by hand, on the activation check's batch: a kernel that gets
    everything wrong (counters, in-flight set, the id sets, placeholder
    sharing, flags) leaves exactly what vLLM's method leaves."""
    verified(1.0)
    from fastbatch import _verify

    def all_wrong(scheduler, output, placeholders, request_type):
        REAL_KERNEL(scheduler, output, placeholders, request_type)
        for request in scheduler.requests.values():
            request.num_in_flight_tokens += 1
            request.is_prefill_chunk = not request.is_prefill_chunk
            request.spec_token_ids = [-1, -1]
        scheduler._inflight_prefills.clear()
        scheduler.finished_req_ids.clear()
        output.has_structured_output_requests = not output.has_structured_output_requests
        return True

    for cls, stock, checked_patch in ((Scheduler, STOCK, patch.PATCH),
                                      (AsyncScheduler, ASYNC_STOCK, patch.ASYNC_PATCH)):
        monkeypatch.setattr(fastbatch, "update_after_schedule", all_wrong)
        for sibling in checked_patch.siblings:  # each patch on its own here
            sibling.divergences = 0
        expected_scheduler, expected_output = patch._small_scheduler(cls, True, True)
        stock(expected_scheduler, expected_output)
        scheduler, output = patch._small_scheduler(cls, True, True)
        old_finished, inflight = scheduler.finished_req_ids, scheduler._inflight_prefills
        checked = _verify.checked_replacement(checked_patch, stock, 1.0)
        assert checked(scheduler, output) is None
        assert checked_patch.divergences == 1
        assert (patch.scheduler_state(scheduler, output)
                == patch.scheduler_state(expected_scheduler, expected_output))
        assert scheduler._inflight_prefills is inflight and old_finished == {"gone"}
        assert scheduler.finished_req_ids is not old_finished
        monkeypatch.setattr(fastbatch, "update_after_schedule", REAL_KERNEL)


def test_verify_sampled_rate_checks_some_calls(verified):
    from fastbatch import _verify

    verified(1.0)  # applied; the rate is forced below
    for rate, low, high in ((0.5, 1, 39), (1.0, 40, 40), (0.0, 0, 0)):
        patch.PATCH.checked = 0

        def make_fast_sampled(workload, rate=rate):
            scheduler = lockstep.make_scheduler(workload)
            scheduler._update_after_schedule = MethodType(
                _verify.checked_replacement(patch.PATCH, STOCK, rate), scheduler)
            return scheduler

        Lockstep(lockstep.WORKLOADS[0], seed=6, make_fast=make_fast_sampled).run(40)
        assert low <= patch.PATCH.checked <= high
        assert patch.PATCH.divergences == 0
