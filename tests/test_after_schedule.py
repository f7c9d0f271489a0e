"""Piece ``after_schedule``: ``Scheduler._update_after_schedule`` and
``AsyncScheduler._update_after_schedule`` with their loops compiled.

Without vLLM (the ``py`` suite): compiled vs twin vs vLLM's two loops
transcribed (0.31.0 to 0.33.0's async loop and 0.34.0's), on generated
batches of stand-in requests whose tokens are a list, an ``array('i')`` or a
local subclass of it like vLLM 0.34.0's ``TokenBuffer``; token stores the
kernel must refuse; bad input.

Against the REAL vLLM scheduler (tox -e vllm, 0.33.0 or 0.34.0): the lockstep
harness (``scheduler_lockstep``) drives a stock scheduler and one whose own
instance carries fastbatch's method, over every workload, and compares after
every step the scheduler outputs, engine-core outputs, KV-cache state and
every request, and here also what only this method touches (the in-flight
prefills, the cleared id sets, which requests share a spec-token placeholder
list, ``last_sched_seq``, ``next_decode_eligible_step``).
``FASTBATCH_LOCKSTEP_STEPS`` sets the total number of steps (default 2,000).
Each lockstep run, with the compiled piece or its pure-Python twin, asserts
from that implementation's own counters that it took requests, and that
the other implementation's counters did not move.

Also: compiled vs twin vs vLLM's own methods on generated batches of real
requests (hypothesis), including batches the kernel must hand back to vLLM;
bad input; the guard, the activation check (which must refuse a kernel that
hands every batch back, or one bound to the other release's variant), the
plugin, ``FASTBATCH=force``; leaks.
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import os
from array import array
from types import MethodType, SimpleNamespace

import pytest
import scheduler_lockstep as lockstep
from hypothesis import given
from hypothesis import strategies as st

import fastbatch
from fastbatch import _kernels, _reference, registry, vllm_plugin
from fastbatch.patches import _stand_ins
from fastbatch.patches import after_schedule as patch
from leaks import assert_no_leak

VLLM = pytest.mark.vllm
if importlib.util.find_spec("vllm") is not None:  # the vllm-marked tests below
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    STOCK = Scheduler._update_after_schedule
    ASYNC_STOCK = AsyncScheduler._update_after_schedule

    class _OtherRequest(Request):
        pass

TOTAL_STEPS = int(os.environ.get("FASTBATCH_LOCKSTEP_STEPS", "2000"))
STEPS_PER_WORKLOAD = max(1, TOTAL_STEPS // len(lockstep.WORKLOADS))
IMPLEMENTATIONS = pytest.mark.parametrize("implementation", [_kernels, _reference],
                                          ids=["compiled", "twin"])


# Without vLLM: stand-in requests, vLLM's loops transcribed ---------------------

class Tokens(array):
    """Like vLLM 0.34.0's ``TokenBuffer``: an ``array('i')`` subclass whose
    slices are lists."""

    __slots__ = ()

    def __getitem__(self, index):
        item = array.__getitem__(self, index)
        return item.tolist() if isinstance(index, slice) else item


class CountedTokens(array):
    """An ``array('i')`` subclass with its own ``__len__``: refused."""

    __slots__ = ()

    def __len__(self):
        return array.__len__(self) + 1


TOKEN_STORES = {"list": list, "array": lambda tokens: array("i", tokens),
                "token-buffer-like": lambda tokens: Tokens("i", tokens)}


class PyRequest:
    """Stands in for vLLM's ``Request``: plain instance attributes, and the
    two properties the methods read, as vLLM 0.31.0 to 0.34.0 write them."""

    def __init__(self, request_id, tokens, computed, placeholders, structured):
        self.request_id = request_id
        self._all_token_ids = tokens
        self.num_computed_tokens = computed
        self.num_in_flight_tokens = self.num_output_placeholders = placeholders
        self.structured_output_request = object() if structured else None
        self.is_prefill_chunk, self.spec_token_ids = False, []
        self.last_sched_seq = self.next_decode_eligible_step = 0

    @property
    def num_tokens(self):
        return len(self._all_token_ids)

    @property
    def use_structured_output(self):
        return self.structured_output_request is not None


def vllm_loops(scheduler, output, placeholders, always_eligible):
    """vLLM's loop of ``Scheduler._update_after_schedule`` (0.31.0 to 0.34.0)
    and, with ``placeholders``, that of ``AsyncScheduler``'s: 0.31.0 to
    0.33.0's (the eligible step only with ``use_v2_model_runner``) or, with
    ``always_eligible``, 0.34.0's."""
    for req_id, num_scheduled_token in output.num_scheduled_tokens.items():
        request = scheduler.requests[req_id]
        request.num_computed_tokens += num_scheduled_token
        request.num_in_flight_tokens += num_scheduled_token
        if scheduler.defer_block_free:
            request.last_sched_seq = scheduler.sched_step_seq
        request.is_prefill_chunk = request.num_computed_tokens < (
            request.num_tokens + request.num_output_placeholders)
        output.has_structured_output_requests |= (
            request.use_structured_output and not request.is_prefill_chunk)
        if not request.is_prefill_chunk:
            scheduler._inflight_prefills.discard(request)
    if placeholders is None:
        return
    spec_decode_tokens = output.scheduled_spec_decode_tokens
    for req_id in output.num_scheduled_tokens:
        request = scheduler.requests[req_id]
        if request.is_prefill_chunk:
            continue
        output.pending_structured_output_tokens |= (
            request.use_structured_output and request.num_output_placeholders > 0)
        request.num_output_placeholders += (
            scheduler.num_sampled_tokens_per_step + len(spec_decode_tokens.get(req_id, ())))
        request.spec_token_ids = placeholders
        if always_eligible or scheduler.use_v2_model_runner:
            request.next_decode_eligible_step = scheduler.current_step + scheduler.decode_stagger


# (prompt length, computed, placeholders, structured, scheduled, spec, in flight)
_PY_ROW = st.tuples(st.integers(1, 40), st.integers(0, 50), st.integers(0, 3), st.booleans(),
                    st.integers(1, 20), st.none() | st.lists(st.integers(0, 63), max_size=3),
                    st.booleans())


def _py_batch(rows, store, defer, release, odd=None):
    """A stand-in scheduler and output; ``release`` "0.33" (with
    ``use_v2_model_runner``: False, True) or "0.34" (no such attribute)."""
    requests, inflight = {}, set()
    output = SimpleNamespace(num_scheduled_tokens={}, scheduled_spec_decode_tokens={},
                             has_structured_output_requests=False,
                             pending_structured_output_tokens=False)
    for index, (prompt, computed, placeholders, structured, scheduled, spec,
                in_flight) in enumerate(rows):
        tokens = TOKEN_STORES[store](range(3, 3 + prompt))
        if odd == "own-len" and index == 0:
            tokens = CountedTokens("i", tokens)
        elif odd == "tuple" and index == 0:
            tokens = tuple(tokens)
        request = PyRequest(f"r{index}", tokens, computed, placeholders, structured)
        requests[request.request_id] = request
        output.num_scheduled_tokens[request.request_id] = scheduled
        if spec is not None:
            output.scheduled_spec_decode_tokens[request.request_id] = spec
        if in_flight:
            inflight.add(request)
    scheduler = SimpleNamespace(requests=requests, _inflight_prefills=inflight,
                                defer_block_free=defer, sched_step_seq=777,
                                num_sampled_tokens_per_step=1, current_step=40,
                                decode_stagger=3)
    if release != "0.34":
        scheduler.use_v2_model_runner = release == "0.33-v2"
    return scheduler, output


def _py_state(scheduler, output):
    return (
        {rid: [(name, type(value := getattr(request, name)), value)
               for name in patch._REQUEST_FIELDS]
         for rid, request in scheduler.requests.items()},
        patch.spec_lists(scheduler.requests.items(), patch._MISSING),
        sorted(request.request_id for request in scheduler._inflight_prefills),
        [(name, type(value := getattr(output, name)), value)
         for name in ("has_structured_output_requests", "pending_structured_output_tokens")],
    )


@given(st.lists(_PY_ROW, max_size=7), st.sampled_from(sorted(TOKEN_STORES)), st.booleans(),
       st.booleans(), st.sampled_from(["0.33", "0.33-v2", "0.34"]),
       st.sampled_from([None, "own-len", "tuple"]))
def test_py_compiled_twin_and_vllm_loops_agree(rows, store, defer, is_async, release, odd):
    always = release == "0.34"
    placeholders = [-1, -1] if is_async else None
    scheduler, output = _py_batch(rows, store, defer, release, odd)
    expected = None
    if odd is None or not rows:
        vllm_loops(scheduler, output, placeholders, always)
        expected = _py_state(scheduler, output)
    for implementation in (_kernels, _reference):
        implementation.reset_stats()
        scheduler, output = _py_batch(rows, store, defer, release, odd)
        before = _py_state(scheduler, output)
        done = implementation.update_after_schedule(scheduler, output, placeholders, PyRequest,
                                                     always_eligible=always)
        if expected is None:  # a token store the kernel must not read: nothing changed
            assert done is False and _py_state(scheduler, output) == before
            assert implementation.after_schedule.stats() == {"requests": 0, "stock_calls": 1}
        else:
            assert done is True and _py_state(scheduler, output) == expected
            assert implementation.after_schedule.stats() == {"requests": len(rows),
                                                              "stock_calls": 0}


@IMPLEMENTATIONS
def test_py_vllm_0_34_never_reads_use_v2_model_runner(implementation):
    rows = [(4, 4, 0, False, 1, [5], True), (30, 0, 0, True, 8, None, True)]
    scheduler, output = _py_batch(rows, "token-buffer-like", True, "0.34")
    with pytest.raises(AttributeError):
        vllm_loops(scheduler, output, [-1], False)  # 0.33.0's loop needs the attribute
    scheduler, output = _py_batch(rows, "token-buffer-like", True, "0.34")
    assert implementation.update_after_schedule(scheduler, output, [-1], PyRequest,
                                                always_eligible=True) is True
    assert scheduler.requests["r0"].next_decode_eligible_step == 43
    assert scheduler.requests["r1"].next_decode_eligible_step == 0  # a prefill chunk
    # Told 0.33.0's variant, it reads the attribute (vLLM's AttributeError, nothing changed).
    scheduler, output = _py_batch(rows, "list", True, "0.34")
    before = _py_state(scheduler, output)
    with pytest.raises(AttributeError):
        implementation.update_after_schedule(scheduler, output, [-1], PyRequest,
                                             always_eligible=False)
    assert _py_state(scheduler, output) == before


@IMPLEMENTATIONS
def test_py_bad_input(implementation):
    scheduler, output = _py_batch([(4, 4, 0, False, 1, None, False)], "list", False, "0.34")
    with pytest.raises(TypeError, match="always_eligible must be a bool"):
        implementation.update_after_schedule(scheduler, output, [-1], PyRequest,
                                             always_eligible=1)
    with pytest.raises(TypeError):  # keyword-only, no default
        implementation.update_after_schedule(scheduler, output, [-1], PyRequest)
    with pytest.raises(TypeError):
        implementation.update_after_schedule(scheduler, output, [-1], PyRequest, True)
    assert scheduler.requests["r0"].num_computed_tokens == 4


def make_fast(workload: lockstep.Workload):
    """A scheduler whose own instance runs fastbatch's method (the classes
    stay stock, so the other scheduler in this process is untouched)."""
    scheduler = lockstep.make_scheduler(workload)
    replacement = (patch._update_after_schedule_async if workload.async_scheduling
                   else patch._update_after_schedule)
    scheduler._update_after_schedule = MethodType(replacement, scheduler)
    return scheduler


def own_state(scheduler):
    """What ``_update_after_schedule`` changes that the harness does not
    compare (which requests share a spec-token list: the scheduler's, up to
    vLLM 0.33.0, or one step's)."""
    placeholders = getattr(scheduler, "_spec_token_placeholders", patch._MISSING)
    return {
        "inflight_prefills": sorted(r.request_id for r in scheduler._inflight_prefills),
        "finished_req_ids": sorted(scheduler.finished_req_ids),
        "reset_preempted_req_ids": sorted(scheduler.reset_preempted_req_ids),
        "spec_token_placeholders": placeholders,
        "requests": {rid: (r.last_sched_seq, r.next_decode_eligible_step,
                           type(r.num_computed_tokens), type(r.num_output_placeholders),
                           type(r.is_prefill_chunk))
                     for rid, r in scheduler.requests.items()},
        "spec_lists": patch.spec_lists(scheduler.requests.items(), placeholders),
    }


class Lockstep(lockstep.Lockstep):
    def _compare_states(self):
        super()._compare_states()
        self._compare("after_schedule", own_state(self.stock), own_state(self.fast))


IDLE = {"requests": 0, "stock_calls": 0}


@VLLM
@pytest.mark.parametrize("workload", lockstep.WORKLOADS, ids=lambda w: w.name)
def test_lockstep_matches_stock(workload):
    _kernels.reset_stats()
    _reference.reset_stats()
    Lockstep(workload, seed=21, make_fast=make_fast).run(STEPS_PER_WORKLOAD)
    counters = fastbatch.stats()["after_schedule"]
    assert counters["requests"] > 0  # the compiled pass took the batches
    assert counters["stock_calls"] == 0  # vLLM's own batches are plain
    assert _reference.after_schedule.stats() == IDLE  # the twin never ran


# Spec decoding (the step's placeholder list is not empty) and structured output.
MORE_WORKLOADS = (*[w for w in lockstep.SPEC_WORKLOADS if w.async_scheduling],
                  lockstep.SPEC_WORKLOADS[1], lockstep.GRAMMAR_WORKLOADS[1],
                  lockstep.GRAMMAR_WORKLOADS[3])


@VLLM
@pytest.mark.parametrize("workload", MORE_WORKLOADS, ids=lambda w: w.name)
def test_lockstep_matches_stock_with_spec_decoding_and_grammars(workload):
    _kernels.reset_stats()
    _reference.reset_stats()
    Lockstep(workload, seed=22, make_fast=make_fast).run(STEPS_PER_WORKLOAD)
    counters = fastbatch.stats()["after_schedule"]
    assert counters["requests"] > 0 and counters["stock_calls"] == 0
    assert _reference.after_schedule.stats() == IDLE


@VLLM
@pytest.mark.parametrize("workload", [lockstep.WORKLOADS[2], lockstep.WORKLOADS[12],
                                      lockstep.SPEC_WORKLOADS[8]], ids=lambda w: w.name)
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
                        "spec_tuple", "tokens_tuple"])


def _scheduler(cls, rows, defer, use_v2, odd):
    """A scheduler of ``cls`` (built without ``__init__``, given only what the
    release's ``__init__`` sets: ``use_v2_model_runner`` only where vLLM has
    it) and a real ``SchedulerOutput`` for ``rows``."""
    scheduler = cls.__new__(cls)
    known = _stand_ins.scheduler_attributes(cls)
    output = SchedulerOutput.make_empty()
    output.num_spec_tokens_to_schedule = len(rows) % 3
    inflight, requests = set(), {}
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
        requests[request.request_id] = request
        output.num_scheduled_tokens[request.request_id] = scheduled
        if spec is not None:
            output.scheduled_spec_decode_tokens[request.request_id] = spec
    values = {"requests": requests, "_inflight_prefills": inflight,
              "defer_block_free": defer, "sched_step_seq": 12345,
              "finished_req_ids": {"f"}, "reset_preempted_req_ids": {"p"},
              "num_sampled_tokens_per_step": 1, "current_step": 300}
    if issubclass(cls, AsyncScheduler):
        values["decode_stagger"] = 1
    if "use_v2_model_runner" in known:  # vLLM up to 0.33.0
        values["use_v2_model_runner"] = use_v2
    assert set(values) <= known, set(values) - known
    for name, value in values.items():
        setattr(scheduler, name, value)
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
    elif rows and odd == "tokens_tuple":
        scheduler.requests["r0"]._all_token_ids = tuple(scheduler.requests["r0"]._all_token_ids)
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


@VLLM
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


@VLLM
@pytest.mark.parametrize("implementation", [_kernels, _reference], ids=["compiled", "twin"])
def test_bad_input(implementation):
    patch._bind()
    always = patch._ALWAYS_ELIGIBLE  # this vLLM's variant
    scheduler, output = _scheduler(AsyncScheduler, _ROWS, False, False, None)
    before = patch.scheduler_state(scheduler, output)
    with pytest.raises(TypeError, match="spec_token_placeholders must be a list or None"):
        implementation.update_after_schedule(scheduler, output, (-1,), Request,
                                             always_eligible=always)
    with pytest.raises(TypeError, match="request_type must be a class"):
        implementation.update_after_schedule(scheduler, output, None, "Request",
                                             always_eligible=always)
    with pytest.raises(TypeError, match="always_eligible must be a bool"):
        implementation.update_after_schedule(scheduler, output, [-1], Request,
                                             always_eligible=None)
    with pytest.raises(AttributeError):
        implementation.update_after_schedule(object(), output, None, Request,
                                             always_eligible=always)
    assert patch.scheduler_state(scheduler, output) == before
    for odd in ("float_count", "missing", "wrong_id", "no_attribute", "subclass", "flag_int",
                "tokens_tuple"):
        scheduler, output = _scheduler(AsyncScheduler, _ROWS, False, False, odd)
        before = patch.scheduler_state(scheduler, output)
        assert implementation.update_after_schedule(scheduler, output, [-1], Request,
                                                    always_eligible=always) is False
        assert patch.scheduler_state(scheduler, output) == before, odd


@VLLM
def test_no_leaks():
    patch._bind()
    always = patch._ALWAYS_ELIGIBLE  # this vLLM's variant

    def step():
        scheduler, output = _scheduler(AsyncScheduler, _ROWS, True, True, None)
        assert _kernels.update_after_schedule(scheduler, output, [-1], Request,
                                              always_eligible=always)

    for _ in range(50):
        step()
    scheduler, output = _scheduler(AsyncScheduler, _ROWS, True, True, None)
    placeholders = [-1, -1]

    def again():
        # The same batch again and again (counters grow; nothing else should).
        _kernels.update_after_schedule(scheduler, output, placeholders, Request,
                                       always_eligible=always)

    for _ in range(3):  # until every request decodes and holds the placeholder list
        again()
    gc.collect()  # earlier tests' requests still hold the Request class
    assert_no_leak(again, [scheduler, output, placeholders, Request,
                           *scheduler.requests.values()], 2000)


# Guard, activation check, plugin ----------------------------------------------------

@VLLM
def test_guard_accepts_this_vllm_and_refuses_a_changed_method():
    import vllm

    assert patch.PATCH.check_target(vllm.__version__, STOCK) is None
    assert patch.ASYNC_PATCH.check_target(vllm.__version__, ASYNC_STOCK) is None
    assert "not a verified variant" in patch.PATCH.check_target(vllm.__version__, make_fast)
    assert "not a verified variant" in patch.ASYNC_PATCH.check_target(vllm.__version__, STOCK)
    assert "not a verified version" in patch.PATCH.check_target("0.30.0", STOCK)
    assert "not a verified version" in patch.ASYNC_PATCH.check_target("0.30.0", ASYNC_STOCK)


@VLLM
def test_activation_check_passes_and_refuses_a_wrong_kernel(monkeypatch):
    assert patch.activation_check(STOCK, patch._update_after_schedule) is None
    assert patch.async_activation_check(ASYNC_STOCK, patch._update_after_schedule_async) is None

    def off_by_one(scheduler, output, placeholders, request_type, *, always_eligible):
        done = _reference.update_after_schedule(scheduler, output, placeholders, request_type,
                                                always_eligible=always_eligible)
        for request in scheduler.requests.values():
            request.num_in_flight_tokens += 1
        return done

    def a_list_per_request(scheduler, output, placeholders, request_type, *, always_eligible):
        done = _reference.update_after_schedule(scheduler, output, placeholders, request_type,
                                                always_eligible=always_eligible)
        for request in scheduler.requests.values():
            if placeholders is not None and request.spec_token_ids is placeholders:
                request.spec_token_ids = list(placeholders)
        return done

    monkeypatch.setattr(fastbatch, "update_after_schedule", off_by_one)
    assert "fastbatch left" in patch.activation_check(STOCK, patch._update_after_schedule)
    monkeypatch.setattr(fastbatch, "update_after_schedule", a_list_per_request)
    assert "fastbatch left" in patch.async_activation_check(
        ASYNC_STOCK, patch._update_after_schedule_async)


@VLLM
def test_activation_check_refuses_a_list_apart_from_the_schedulers(monkeypatch):
    """Up to vLLM 0.33.0 the scheduler keeps the step's list: requests must
    hold that one.  (vLLM 0.34.0 keeps it nowhere: there the check compares
    which requests share one list, the test above.)"""
    if "_spec_token_placeholders" not in _stand_ins.scheduler_attributes(AsyncScheduler):
        assert patch.async_variant(ASYNC_STOCK)[0] is False
        return  # this vLLM's counterpart: a_list_per_request above

    def drops_placeholder_sharing(scheduler, output, placeholders, request_type, *,
                                  always_eligible):
        return _reference.update_after_schedule(
            scheduler, output, None if placeholders is None else list(placeholders),
            request_type, always_eligible=always_eligible)

    monkeypatch.setattr(fastbatch, "update_after_schedule", drops_placeholder_sharing)
    assert "fastbatch left" in patch.async_activation_check(
        ASYNC_STOCK, patch._update_after_schedule_async)


@VLLM
def test_activation_check_refuses_a_kernel_that_takes_nothing(monkeypatch):
    """A kernel that hands every batch back to vLLM's method leaves vLLM's
    results, and must still be refused: it would not act."""
    def hands_back(scheduler, output, placeholders, request_type, *, always_eligible):
        # The real kernel, refusing each request (not of the class it is told)
        return REAL_KERNEL(scheduler, output, placeholders, _OtherRequest,
                           always_eligible=always_eligible)

    monkeypatch.setattr(fastbatch, "update_after_schedule", hands_back)
    for check, stock, replacement in (
            (patch.activation_check, STOCK, patch._update_after_schedule),
            (patch.async_activation_check, ASYNC_STOCK, patch._update_after_schedule_async)):
        problem = check(stock, replacement)
        assert "took 0 of 6 requests and handed 1 batch(es) back" in problem
        assert "would not act" in problem


@VLLM
def test_the_variant_follows_this_vllm():
    """Bound from the async method's fingerprint, with the same answer as
    this vLLM's objects give: whether its scheduler keeps a placeholder list
    and has ``use_v2_model_runner``."""
    attributes = _stand_ins.scheduler_attributes(AsyncScheduler)
    keeps, always = patch.async_variant(ASYNC_STOCK)
    assert keeps == ("_spec_token_placeholders" in attributes)
    assert always == ("use_v2_model_runner" not in attributes)
    assert {"requests", "current_step", "decode_stagger", "_inflight_prefills"} <= attributes
    assert "decode_stagger" not in _stand_ins.scheduler_attributes(Scheduler)
    patch._bind()
    assert (keeps, always) == (patch._KEEPS_PLACEHOLDERS, patch._ALWAYS_ELIGIBLE)
    # Code the guard does not know (FASTBATCH=force): read off the names it uses.
    def unknown(self, scheduler_output):
        self.use_v2_model_runner  # noqa: B018
    assert patch.async_variant(unknown) == (False, False)


@VLLM
def test_force_refuses_the_other_releases_variant(monkeypatch, logs):
    """Bound to the other release's variant (0.33.0's on 0.34.0: it reads the
    ``use_v2_model_runner`` that 0.34.0 has not; 0.34.0's on 0.33.0), the
    async replacement fails its activation check: ``FASTBATCH=force`` leaves
    vLLM stock."""
    keeps, always = patch.async_variant(ASYNC_STOCK)
    piece = registry.piece("after_schedule")
    piece.revert()
    monkeypatch.setattr(patch, "async_variant", lambda method: (not keeps, not always))
    try:
        assert patch.ASYNC_PATCH.apply(force=True) is False
        assert AsyncScheduler._update_after_schedule is ASYNC_STOCK
    finally:
        piece.revert()
        monkeypatch.undo()
        patch._bind()  # this vLLM's variant again, for the tests that follow
    assert patch.async_variant(ASYNC_STOCK) == (keeps, always)
    (error,) = [line for line in logs.at(logging.ERROR) if "activation check failed" in line]
    assert "AsyncScheduler._update_after_schedule" in error


@VLLM
@pytest.mark.parametrize("workload", [lockstep.WORKLOADS[0], lockstep.WORKLOADS[12],
                                      lockstep.SPEC_WORKLOADS[8]], ids=lambda w: w.name)
def test_force_installs_and_real_schedulers_step(workload):
    """``FASTBATCH=force`` (each patch applied with ``force``) on this vLLM:
    both classes replaced, and real schedulers built by vLLM's ``__init__``
    step with the compiled call taking every batch."""
    piece = registry.piece("after_schedule")
    piece.revert()
    try:
        assert all(one.apply(force=True) for one in piece.patches)
        assert AsyncScheduler._update_after_schedule is patch._update_after_schedule_async
        _kernels.reset_stats()
        # Both sides run the installed methods here: they must agree and not raise.
        Lockstep(workload, seed=8, make_fast=lockstep.make_scheduler).run(40)
        counters = fastbatch.stats()["after_schedule"]
        assert counters["requests"] > 0 and counters["stock_calls"] == 0
    finally:
        piece.revert()
    assert AsyncScheduler._update_after_schedule is ASYNC_STOCK


@VLLM
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


@VLLM
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


@VLLM
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
    def kernel(scheduler, output, placeholders, request_type, *, always_eligible):
        calls.append(len(output.num_scheduled_tokens))
        done = REAL_KERNEL(scheduler, output, placeholders, request_type,
                           always_eligible=always_eligible)
        if done and len(output.num_scheduled_tokens) > 6:
            scheduler.requests[next(iter(output.num_scheduled_tokens))].num_computed_tokens += 1
        return done
    return kernel


@VLLM
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


@VLLM
def test_verify_divergence_restores_every_field_in_the_live_objects(verified, monkeypatch):
    """One call by hand, on the activation check's batch: a kernel that gets
    everything wrong (counters, in-flight set, the id sets, placeholder
    sharing, flags) leaves exactly what vLLM's method leaves."""
    verified(1.0)
    from fastbatch import _verify

    def all_wrong(scheduler, output, placeholders, request_type, *, always_eligible):
        REAL_KERNEL(scheduler, output, placeholders, request_type,
                    always_eligible=always_eligible)
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
        use_v2 = _stand_ins.use_v2_values(cls)[-1]  # True where vLLM has the flag
        expected_scheduler, expected_output = patch._small_scheduler(cls, True, use_v2)
        stock(expected_scheduler, expected_output)
        scheduler, output = patch._small_scheduler(cls, True, use_v2)
        old_finished, inflight = scheduler.finished_req_ids, scheduler._inflight_prefills
        checked = _verify.checked_replacement(checked_patch, stock, 1.0)
        assert checked(scheduler, output) is None
        assert checked_patch.divergences == 1
        assert (patch.scheduler_state(scheduler, output)
                == patch.scheduler_state(expected_scheduler, expected_output))
        assert scheduler._inflight_prefills is inflight and old_finished == {"gone"}
        assert scheduler.finished_req_ids is not old_finished
        monkeypatch.setattr(fastbatch, "update_after_schedule", REAL_KERNEL)


@VLLM
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
