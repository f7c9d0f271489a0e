"""Piece ``update_from_output``: the plain decodes of ``Scheduler.update_from_output``.

Against the REAL vLLM scheduler (0.33.0 and 0.34.0), no model: the lockstep
harness (``scheduler_lockstep``) drives a stock scheduler and one whose
``update_from_output`` goes through fastbatch (alone, and together with every
other scheduler piece: ``allocate_slots``, ``_update_after_schedule``,
``_make_cached_request_data``), with the same requests and model
outputs, and compares scheduler outputs, engine-core outputs, the KV-cache
state and every request after every step, over workloads that leave the fast
path (prefix caching on and off, async and sync scheduling, EOS, stop tokens,
min_tokens, max_tokens, aborts, preemption, chunked prefill, block
boundaries, arrivals every step, the Model Runner V2 branches).
``FASTBATCH_LOCKSTEP_STEPS`` sets the total number of steps (default 2,000;
the report runs >= 10,000).
Each lockstep run, with the compiled piece or its pure-Python twin, asserts
from that implementation's own counters that it took requests, and that
the other implementation's counters did not move.

Requests with sample logprobs (``logprobs`` 0, 1, 5 and -1, mixed with plain
ones; the runner's ``LogprobsLists`` by row, through
``cu_num_generated_tokens``, or None): the lockstep's ``LOGPROB_WORKLOADS``
(kernel and twin, with the shadow check too), one step against vLLM's method
on a stand-in scheduler with the slices checked as views of the same
buffers, and planted wrong logprobs (a wrong row, a wrong dtype) that the
activation check and ``FASTBATCH_VERIFY`` must catch.

vLLM 0.34.0 (``ROWS_FROM_REQ_IDS``): rows found in ``req_ids`` (in order,
reversed, an id listed twice), ``_all_token_ids`` as a ``TokenBuffer``, and
on every release as a local ``array('i')`` subclass (tokens past a C int go to
vLLM), the Mamba caching rule (older releases: the same steps, unread).
Issue 52: a scheduler missing any one attribute ends as vLLM's does.

Also: compiled vs twin on generated real requests (hypothesis); the guard,
the activation check (refuses a wrong kernel), bad input (nothing changed),
leaks; the plugin, by the piece's name and by its deprecated 0.1 name
``scheduler_outputs``.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import logging
import os
from array import array
from types import MethodType, SimpleNamespace

import numpy
import pytest
import scheduler_lockstep as lockstep
from hypothesis import given
from hypothesis import strategies as st
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import LogprobsLists, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.utils import ConstantList

import fastbatch
from fastbatch import _kernels, _reference, _verify, registry, vllm_plugin
from fastbatch.patches import (
    _compare,
    _stand_ins,
    after_schedule,
    allocate_slots,
    cached_requests,
    schedule_running,
)
from fastbatch.patches import update_from_output as patch
from leaks import assert_no_leak

pytestmark = pytest.mark.vllm
STOCK = Scheduler.update_from_output
# vLLM 0.34.0 removed ModelRunnerOutput.req_id_to_index: vLLM finds a request's
# row in req_ids (the kernel's variant 3); older releases by the index map.
ROWS_FROM_REQ_IDS = "req_id_to_index" not in ModelRunnerOutput.__dataclass_fields__
VARIANT = 3 if ROWS_FROM_REQ_IDS else 0  # this vLLM's rule for both scheduler classes


def row_of(runner_output, request_id):
    """The row vLLM reads for ``request_id`` (the last position of its id in
    req_ids on vLLM 0.34.0)."""
    if ROWS_FROM_REQ_IDS:
        return {rid: i for i, rid in enumerate(runner_output.req_ids)}[request_id]
    return runner_output.req_id_to_index[request_id]
TOTAL_STEPS = int(os.environ.get("FASTBATCH_LOCKSTEP_STEPS", "2000"))
STEPS_PER_WORKLOAD = max(1, TOTAL_STEPS // len(lockstep.WORKLOADS))


def make_fast(workload: lockstep.Workload):
    """A scheduler whose own ``update_from_output`` goes through fastbatch (the
    class stays stock, so the other scheduler in this process is untouched)."""
    scheduler = lockstep.make_scheduler(workload)
    scheduler.update_from_output = MethodType(patch.update_from_output, scheduler)
    return scheduler


def _verified(*patches):
    """This vLLM is a verified target of every one of ``patches`` (their guard)."""
    import vllm

    return all(one.check_target(vllm.__version__, one.current()) is None for one in patches)


# The other scheduler pieces that FASTBATCH=1 would install on this vLLM (on
# vLLM 0.34.0 those not ported yet are left out, as the guard leaves them stock).
OTHER_PIECES = {name: _verified(*patches) for name, patches in (
    ("allocate_slots", (allocate_slots.PATCH,)), ("after_schedule", after_schedule.PATCHES),
    ("cached_requests", (cached_requests.PATCH,)), ("schedule_running", (schedule_running.PATCH,)))}


def make_fast_with_every_scheduler_piece(workload: lockstep.Workload):
    """As ``FASTBATCH=1`` leaves a scheduler: this piece with ``allocate_slots``,
    ``after_schedule``, ``cached_requests`` and ``schedule_running`` (those of
    them this vLLM is a verified target for, ``OTHER_PIECES``)."""
    scheduler = make_fast(workload)
    if OTHER_PIECES["schedule_running"]:
        schedule_running.bind()
        scheduler.schedule = MethodType(schedule_running.schedule, scheduler)
    if OTHER_PIECES["allocate_slots"]:
        allocate_slots.bind()
        manager = scheduler.kv_cache_manager
        manager.allocate_slots = MethodType(allocate_slots.allocate_slots, manager)
    if OTHER_PIECES["after_schedule"]:
        after = (after_schedule._update_after_schedule_async if workload.async_scheduling
                 else after_schedule._update_after_schedule)
        scheduler._update_after_schedule = MethodType(after, scheduler)
    if OTHER_PIECES["cached_requests"]:
        scheduler._make_cached_request_data = MethodType(
            cached_requests._make_cached_request_data, scheduler)
    return scheduler


SCHEDULER_PIECES = ("after_schedule", "allocate_slots", "cached_requests",
                    "schedule_running", "update_from_output")


def idle(stats, names=SCHEDULER_PIECES):
    """Whether none of the counters of pieces ``names`` in ``stats`` moved."""
    return all(not any(stats[name].values()) for name in names)


@pytest.mark.parametrize("workload", lockstep.WORKLOADS, ids=lambda w: w.name)
def test_lockstep_fast_path_matches_stock(workload):
    _kernels.reset_stats()
    _reference.reset_stats()
    harness = lockstep.Lockstep(workload, seed=21, make_fast=make_fast)
    harness.run(STEPS_PER_WORKLOAD)  # raises Divergence at the first difference
    counters = fastbatch.stats()
    assert counters["update_from_output"]["fast_outputs"] > 0  # the fast path was taken
    assert counters["update_from_output"]["stock_outputs"] > 0  # and left
    assert idle(counters, ("after_schedule", "allocate_slots", "cached_requests"))
    assert idle(_reference.stats())  # the twin never ran
    if workload.name.startswith("preemption"):
        assert harness.preemptions > 0


@pytest.mark.parametrize("workload", [lockstep.WORKLOADS[3], lockstep.WORKLOADS[6]],
                         ids=lambda w: w.name)
def test_lockstep_with_the_pure_python_twin(monkeypatch, workload):
    monkeypatch.setattr(fastbatch, "take_decode_outputs", _reference.take_decode_outputs)
    monkeypatch.setattr(fastbatch, "merge_decode_outputs", _reference.merge_decode_outputs)
    _kernels.reset_stats()
    _reference.reset_stats()
    lockstep.Lockstep(workload, seed=5, make_fast=make_fast).run(60)
    counters = _reference.update_from_output.stats()
    assert counters["fast_outputs"] > 0  # the twin took requests
    assert counters["stock_outputs"] > 0  # and left some to vLLM
    assert idle(_reference.stats(), ("after_schedule", "allocate_slots", "cached_requests"))
    assert idle(_kernels.stats())  # no compiled piece ran


def rows_reversed(monkeypatch):
    """The lockstep's runner outputs with their rows in reverse scheduling
    order (vLLM 0.34.0's model runner lists its batch, not
    num_scheduled_tokens), for steps without sample logprobs."""
    original = lockstep.Lockstep._runner_output

    def reversed_rows(scheduler_output, sampled, logprobs=None):
        output = original(scheduler_output, sampled, logprobs)
        if logprobs is None:
            output.req_ids.reverse()
            output.sampled_token_ids.reverse()
            if not ROWS_FROM_REQ_IDS:
                output.req_id_to_index = {rid: i for i, rid in enumerate(output.req_ids)}
        return output

    monkeypatch.setattr(lockstep.Lockstep, "_runner_output", staticmethod(reversed_rows))


@pytest.mark.parametrize("workload", [lockstep.WORKLOADS[2], lockstep.WORKLOADS[3],
                                      lockstep.SPEC_WORKLOADS[0], lockstep.SPEC_WORKLOADS[-1]],
                         ids=lambda w: w.name)
def test_lockstep_with_rows_out_of_scheduling_order(monkeypatch, workload):
    rows_reversed(monkeypatch)
    _kernels.reset_stats()
    lockstep.Lockstep(workload, seed=19, make_fast=make_fast).run(STEPS_PER_WORKLOAD)
    assert fastbatch.stats()["update_from_output"]["fast_outputs"] > 0


def watching_takes(monkeypatch, implementation, watch):
    """``implementation``'s call in fastbatch's place, ``watch(scheduler,
    scheduler_output, model_runner_output, more, outputs)`` seeing each call:
    ``more`` its arguments after ``variant``, ``outputs`` those of the
    requests it took."""

    def take(scheduler, scheduler_output, model_runner_output, kinds, variant, *more):
        result = implementation.take_decode_outputs(scheduler, scheduler_output,
                                                    model_runner_output, kinds, variant, *more)
        outputs = [slot for slot in (result[0] if result is not None else ())
                   if type(slot) is not str]
        watch(scheduler, scheduler_output, model_runner_output, more, outputs)
        return result

    monkeypatch.setattr(fastbatch, "take_decode_outputs", take)
    monkeypatch.setattr(fastbatch, "merge_decode_outputs", implementation.merge_decode_outputs)


def counting_logprob_takes(monkeypatch, implementation):
    """``implementation``'s call, recording for each request with sample
    logprobs it took: (its logprobs, whether its output has new_logprobs,
    whether the runner's were found through cu_num_generated_tokens)."""
    taken = []

    def watch(scheduler, scheduler_output, model_runner_output, more, outputs):
        runner = model_runner_output.logprobs
        for output in outputs:
            value = scheduler.requests[output.request_id].sampling_params.logprobs
            if value is not None:
                taken.append((value, output.new_logprobs is not None,
                              runner is not None and runner.cu_num_generated_tokens is not None))

    watching_takes(monkeypatch, implementation, watch)
    return taken


def assert_took_logprob_requests(workload, taken):
    assert {value for value, _, _ in taken} == set(lockstep.LOGPROB_CHOICES)
    assert any(sliced and not cu for _, sliced, cu in taken) == ("rows" in
                                                                workload.runner_logprobs)
    assert any(sliced and cu for _, sliced, cu in taken) == ("cu" in workload.runner_logprobs)
    assert any(not sliced for _, sliced, _ in taken) == ("none" in workload.runner_logprobs)


@pytest.mark.parametrize("workload", lockstep.LOGPROB_WORKLOADS, ids=lambda w: w.name)
def test_lockstep_with_logprobs(monkeypatch, workload):
    """Requests with sample logprobs (0, 1, 5, -1) among plain ones: the
    compiled call takes them (by row, through cu_num_generated_tokens, or
    with none in the runner's output) and leaves those that stop, exactly."""
    taken = counting_logprob_takes(monkeypatch, _kernels)
    _kernels.reset_stats()
    _reference.reset_stats()
    lockstep.Lockstep(workload, seed=17, make_fast=make_fast).run(150)
    counters = fastbatch.stats()["update_from_output"]
    assert counters["fast_outputs"] > 0 and counters["stock_outputs"] > 0
    assert_took_logprob_requests(workload, taken)
    assert idle(_reference.stats())  # the twin never ran


@pytest.mark.parametrize("workload", lockstep.LOGPROB_WORKLOADS[1:3], ids=lambda w: w.name)
def test_lockstep_with_logprobs_and_the_pure_python_twin(monkeypatch, workload):
    taken = counting_logprob_takes(monkeypatch, _reference)
    _kernels.reset_stats()
    _reference.reset_stats()
    lockstep.Lockstep(workload, seed=6, make_fast=make_fast).run(100)
    assert _reference.update_from_output.stats()["fast_outputs"] > 0
    assert_took_logprob_requests(workload, taken)
    assert idle(_kernels.stats())  # no compiled piece ran


def test_lockstep_with_logprobs_and_every_scheduler_piece(monkeypatch):
    workload = lockstep.LOGPROB_WORKLOADS[1]
    taken = counting_logprob_takes(monkeypatch, _kernels)
    lockstep.Lockstep(workload, seed=9,
                      make_fast=make_fast_with_every_scheduler_piece).run(100)
    assert_took_logprob_requests(workload, taken)


def counting_grammar_takes(monkeypatch, implementation):
    """``implementation``'s call, counting the requests with a grammar it
    took, and those it gave back to vLLM's loop because the grammar refused
    their token."""
    counts = {"taken": 0, "refused": 0}

    def watch(scheduler, scheduler_output, model_runner_output, more, outputs):
        counts["refused"] += len(more[2]) if len(more) > 2 else 0
        counts["taken"] += sum(scheduler.requests[output.request_id].structured_output_request
                               is not None for output in outputs)

    watching_takes(monkeypatch, implementation, watch)
    return counts


@pytest.mark.parametrize("workload", lockstep.GRAMMAR_WORKLOADS, ids=lambda w: w.name)
def test_lockstep_with_grammars(monkeypatch, workload):
    """Requests with a grammar (vLLM's own ``StructuredOutputManager`` over a
    stand-in grammar that refuses a token or none) among plain ones: the
    compiled call takes them and has the grammar accept their tokens, and
    gives back to vLLM's loop, unchanged, those whose token is refused
    (vLLM stops them with an error); the grammars' tokens are compared with
    the rest of each request."""
    counts = counting_grammar_takes(monkeypatch, _kernels)
    _reference.reset_stats()
    refusals = []
    handler = logging.Handler()
    handler.emit = lambda record: refusals.append(record.getMessage())
    scheduler_logger = logging.getLogger(patch.MODULE)  # vLLM's: it does not propagate
    scheduler_logger.addHandler(handler)
    try:
        lockstep.Lockstep(workload, seed=23, make_fast=make_fast).run(150)
    finally:
        scheduler_logger.removeHandler(handler)
    assert counts["taken"] > 0 and counts["refused"] > 0, counts
    # vLLM logs each refusal once on each side (a second ask would log again).
    logged = collections.Counter(line for line in refusals if "grammar rejected" in line)
    assert len(logged) >= counts["refused"] and set(logged.values()) == {2}, logged
    assert idle(_reference.stats())  # the twin never ran


@pytest.mark.parametrize("workload", lockstep.GRAMMAR_WORKLOADS[1:3], ids=lambda w: w.name)
def test_lockstep_with_grammars_and_the_pure_python_twin(monkeypatch, workload):
    counts = counting_grammar_takes(monkeypatch, _reference)
    _kernels.reset_stats()
    lockstep.Lockstep(workload, seed=29, make_fast=make_fast).run(100)
    assert counts["taken"] > 0 and counts["refused"] > 0, counts
    assert idle(_kernels.stats())  # no compiled piece ran


def test_lockstep_with_grammars_and_every_scheduler_piece(monkeypatch):
    counts = counting_grammar_takes(monkeypatch, _kernels)
    lockstep.Lockstep(lockstep.GRAMMAR_WORKLOADS[1], seed=31,
                      make_fast=make_fast_with_every_scheduler_piece).run(100)
    assert counts["taken"] > 0 and counts["refused"] > 0, counts


def counting_draft_takes(monkeypatch, implementation):
    """``implementation``'s call, counting the requests with scheduled drafts
    it took: all, and those with drafts rejected."""
    counts = {"with_drafts": 0, "rejected": 0}

    def watch(scheduler, scheduler_output, model_runner_output, more, outputs):
        scheduled_drafts = scheduler_output.scheduled_spec_decode_tokens
        for output in outputs:
            if scheduled_drafts.get(output.request_id):
                counts["with_drafts"] += 1
                accepted = len(output.new_token_ids) - 1
                counts["rejected"] += accepted < len(scheduled_drafts[output.request_id])

    watching_takes(monkeypatch, implementation, watch)
    return counts


@pytest.mark.parametrize("workload", lockstep.SPEC_WORKLOADS, ids=lambda w: w.name)
def test_lockstep_spec_decode_matches_stock(monkeypatch, workload):
    """Spec decoding, sync (the drafter's drafts) and async (the scheduler's
    placeholders): the requests with drafts are taken, the rejected drafts
    taken back from the computed and placeholder counts, exactly."""
    counts = counting_draft_takes(monkeypatch, _kernels)
    _kernels.reset_stats()
    _reference.reset_stats()
    harness = lockstep.Lockstep(workload, seed=23, make_fast=make_fast)
    harness.run(STEPS_PER_WORKLOAD)  # raises Divergence at the first difference
    assert counts["with_drafts"] > 0
    assert (counts["rejected"] > 0) == (workload.draft_acceptance != ("all",))
    assert fastbatch.stats()["update_from_output"]["stock_outputs"] > 0
    assert idle(_reference.stats())  # the twin never ran
    if workload.name.endswith("preemption"):
        assert harness.preemptions > 0


@pytest.mark.parametrize("workload", [lockstep.SPEC_WORKLOADS[1], lockstep.SPEC_WORKLOADS[-3]],
                         ids=lambda w: w.name)
def test_lockstep_spec_decode_with_the_pure_python_twin(monkeypatch, workload):
    counts = counting_draft_takes(monkeypatch, _reference)
    _kernels.reset_stats()
    _reference.reset_stats()
    lockstep.Lockstep(workload, seed=7, make_fast=make_fast).run(80)
    assert counts["with_drafts"] > 0 and counts["rejected"] > 0
    assert idle(_kernels.stats())  # no compiled piece ran


def test_drafts_are_left_to_vllm_with_invalidated_drafts_or_several_samples():
    """With statistics kept, requests with drafts are taken (their drafts
    counted by vLLM's make_spec_decoding_stats) unless a grammar invalidated
    drafts this step; with other than one sampled token per step the
    accepted count differs: then they are not taken."""
    scheduler = lockstep.make_scheduler(lockstep.SPEC_WORKLOADS[0])
    drafts = {"a": [5, 6]}
    output = SimpleNamespace(num_invalid_spec_tokens=None, scheduled_spec_decode_tokens=drafts)
    assert patch._takes_drafts(scheduler, output) is True
    scheduler.log_stats = True
    assert patch._takes_drafts(scheduler, output) is True
    assert patch._takes_drafts(scheduler, SimpleNamespace(
        num_invalid_spec_tokens={"a": 1}, scheduled_spec_decode_tokens=drafts)) is False
    scheduler.log_stats, scheduler.num_sampled_tokens_per_step = False, 0
    assert patch._takes_drafts(scheduler, output) is False
    # A step without drafts reads nothing of this (vLLM reads it only for a
    # request with drafts): a scheduler without it is fine.
    del scheduler.num_sampled_tokens_per_step
    assert patch._takes_drafts(scheduler, SimpleNamespace(scheduled_spec_decode_tokens={})) \
        is False
    assert patch._takes_drafts(scheduler, output) is False


STATS_WORKLOADS = tuple(dataclasses.replace(workload, name=f"{workload.name}-stats",
                                            log_stats=True)
                        for workload in (lockstep.WORKLOADS[0], lockstep.SPEC_WORKLOADS[0],
                                         lockstep.SPEC_WORKLOADS[-1]))


@pytest.mark.parametrize("workload", STATS_WORKLOADS, ids=lambda w: w.name)
def test_lockstep_with_statistics(monkeypatch, workload):
    """``log_stats`` on (vllm serve's default): every step's SchedulerStats,
    spec decoding's counts included, as stock's; requests with drafts taken."""
    counts = counting_draft_takes(monkeypatch, _kernels)
    _kernels.reset_stats()
    lockstep.Lockstep(workload, seed=13, make_fast=make_fast).run(STEPS_PER_WORKLOAD)
    assert fastbatch.stats()["update_from_output"]["fast_outputs"] > 0
    if workload.num_spec_tokens:
        assert counts["with_drafts"] > 0 and counts["rejected"] > 0


@pytest.mark.parametrize("implementation", ["compiled", "reference"], indirect=True)
def test_without_drafts_flag_requests_with_drafts_are_left(implementation):
    """``drafts=False`` leaves the requests with drafts to vLLM's loop; ``True``
    takes them (the same step, built twice from the same seed)."""
    patch._bind()
    taken_ids = []
    for drafts in (False, True):
        harness = lockstep.Lockstep(lockstep.SPEC_WORKLOADS[0], seed=3)
        for _ in range(6):
            harness.step()
        scheduler = harness.stock
        scheduler_output = scheduler.schedule()
        runner_output = harness._runner_output(scheduler_output,
                                               harness._sample(scheduler_output), None)
        taken = implementation.take_decode_outputs(scheduler, scheduler_output, runner_output,
                                                   patch._KINDS, patch._variant(scheduler),
                                                   drafts)
        with_drafts = set(scheduler_output.scheduled_spec_decode_tokens)
        assert with_drafts
        taken_ids.append(with_drafts & {slot.request_id for slot in
                                        (taken[0] if taken is not None else ())
                                        if type(slot) is not str})
    assert taken_ids[0] == set() and taken_ids[1] != set()


# Compiled vs twin on generated states of real requests over a real small KV
# cache manager (the stand-in scheduler of the activation check).

def _state(cls, caching, specs, stop_every, logprobs=None, runner_logprobs="none",
           requests=None, reverse_rows=False, index_map=False, token_store=None):
    """A stand-in scheduler over real requests (``specs``), its scheduler
    output and runner output; ``logprobs``: each request's sample logprobs
    (else the stand-in requests' own: None, 1, 0, -1); ``runner_logprobs``:
    the runner's (see ``_runner_logprobs``); ``requests``: the requests (else
    the stand-in ones, as many as ``specs``); ``reverse_rows``: the runner's
    rows in reverse scheduling order; ``index_map``: the runner output has a
    ``req_id_to_index`` even where vLLM dropped it (compiled against twin in
    variants 0 to 2); ``token_store``: each request's ``_all_token_ids``
    becomes this type (an ``array('i')`` subclass)."""
    requests = requests or _stand_ins.stand_in_requests()[:len(specs)]
    for request, value in zip(requests, logprobs or (), strict=False):
        request.sampling_params.logprobs = value
    scheduler = _stand_ins.stand_in_scheduler(cls, caching, requests)
    manager = scheduler.kv_cache_manager
    scheduled, sampled = {}, []
    for request, (outputs, token, in_flight, placeholders, status, max_tokens) in zip(
            requests, specs, strict=True):
        request.max_tokens = max_tokens
        request.take_prefill_stats()  # as the prefill's output did
        manager.allocate_slots(request, request.num_tokens)
        for index in range(outputs):
            request.append_output_token_ids(40 + index)
        manager.allocate_slots(request, request.num_tokens - request.num_computed_tokens)
        request.num_computed_tokens = request.num_tokens + in_flight - 1
        if caching and stop_every:
            manager.cache_blocks(request, request.num_computed_tokens - in_flight)
        request.num_in_flight_tokens = in_flight
        request.num_output_placeholders = placeholders
        request.status = status
        if token_store is not None:
            request._all_token_ids = token_store(request._all_token_ids)
            request.all_token_ids = ConstantList(request._all_token_ids)
        scheduled[request.request_id] = in_flight or 1
        sampled.append([token])
    req_ids = list(scheduled)
    if reverse_rows:
        req_ids, sampled = req_ids[::-1], sampled[::-1]
    runner_output = runner_output_of(req_ids, sampled,
                                     _runner_logprobs(runner_logprobs, len(req_ids)))
    if index_map and ROWS_FROM_REQ_IDS:
        runner_output.req_id_to_index = {rid: i for i, rid in enumerate(req_ids)}
    scheduler_output = SimpleNamespace(num_scheduled_tokens=scheduled,
                                       scheduled_spec_decode_tokens={},
                                       total_num_scheduled_tokens=sum(scheduled.values()),
                                       num_invalid_spec_tokens=None)
    return scheduler, scheduler_output, runner_output


def runner_output_of(req_ids, sampled, logprobs=None):
    """vLLM's ModelRunnerOutput (with ``req_id_to_index`` where it has one)."""
    indices = ({} if ROWS_FROM_REQ_IDS else
               {"req_id_to_index": {rid: i for i, rid in enumerate(req_ids)}})
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, logprobs=logprobs,
                             **indices)


class Int32Tokens(array):
    """A local ``array('i')`` subclass, as vLLM 0.34.0's TokenBuffer is one."""

    __slots__ = ()

    def __new__(cls, tokens=()):
        return super().__new__(cls, "i", tokens)


RUNNER_LOGPROBS = ("none", "rows", "cu", "cu-short", "cu-not-int", "tuple", "lists",
                   "0-d")


def _runner_logprobs(mode, num_rows):
    """The runner's sample logprobs: None ("none"); a LogprobsLists of numpy
    arrays (strided token ids) with a row per request ("rows") or found
    through cu_num_generated_tokens, rows shifted by two ("cu"); and what the
    fast path leaves to vLLM: a cu list too short for the last request, or
    with a float for the second; a plain tuple; lists for arrays; 0-d arrays."""
    if mode == "none":
        return None
    rows = num_rows + 2
    ids = numpy.arange(rows * 14, dtype=numpy.int32).reshape(rows, 14)[:, ::2] + 3
    values = numpy.linspace(-9, 0, rows * 7, dtype=numpy.float32).reshape(rows, 7)
    ranks = numpy.arange(rows, dtype=numpy.int64) + 1
    cu = {"cu": list(range(2, rows)), "cu-short": list(range(2, rows - 1)),
          "cu-not-int": [2, 3.0, *range(4, rows)]}.get(mode)
    if mode == "tuple":
        return (ids, values, ranks, None)
    if mode == "lists":
        return LogprobsLists(ids.tolist(), values.tolist(), ranks.tolist(), None)
    if mode == "0-d":
        return LogprobsLists(numpy.array(1), values, ranks, None)
    return LogprobsLists(ids, values, ranks, cu)


def _plain(result, scheduler):
    if result is not None:
        slots, rest = result
        result = ([slot if type(slot) is str else _compare.plain(slot) for slot in slots],
                  rest)
    return result, _stand_ins.side_state(scheduler, {})


def assert_same_slice(ours, theirs):
    """``ours`` is what ``LogprobsLists.slice_request`` gave (``theirs``):
    the same type, and views of the same buffers with the same dtype, shape,
    strides and values, and None as its fourth item."""
    assert type(ours) is type(theirs) is LogprobsLists
    assert len(ours) == len(theirs) == 4 and ours[3] is None and theirs[3] is None
    for mine, stock in zip(ours[:3], theirs[:3], strict=True):
        assert type(mine) is type(stock) is numpy.ndarray
        assert mine is not stock and mine.base is stock.base is not None
        assert (mine.dtype, mine.shape, mine.strides) == (stock.dtype, stock.shape,
                                                          stock.strides)
        assert (mine.__array_interface__["data"] == stock.__array_interface__["data"])
        assert mine.tobytes() == stock.tobytes()


REQUEST_SPECS = st.tuples(
    st.integers(0, 9),  # outputs so far
    st.sampled_from([2, 31, 7, 40, 2**40]),  # sampled token: EOS, a stop token, others
    st.integers(0, 2),  # in-flight tokens
    st.integers(0, 2),  # output placeholders
    st.sampled_from([RequestStatus.RUNNING, RequestStatus.PREEMPTED]),
    st.integers(1, 14))  # max_tokens


@given(st.sampled_from([Scheduler, AsyncScheduler]), st.booleans(),
       st.lists(REQUEST_SPECS, min_size=1, max_size=4), st.booleans(),
       st.sampled_from([0, 1, 2, 3]),
       st.lists(st.sampled_from([None, 0, 1, 5, -1]), max_size=4),
       st.sampled_from(RUNNER_LOGPROBS), st.booleans(), st.sampled_from([None, Int32Tokens]))
def test_compiled_matches_twin(cls, caching, specs, cache_some, variant, logprobs,
                               runner_logprobs, reverse_rows, token_store):
    """Every variant (3: rows from req_ids) on this vLLM's requests, their
    token lists as they are or an ``array('i')`` subclass, the runner's rows
    in scheduling order or reversed."""
    patch._bind()
    compiled_side, twin_side = (
        _state(cls, caching, specs, cache_some, logprobs, runner_logprobs,
               reverse_rows=reverse_rows, index_map=True, token_store=token_store)
        for _ in range(2))
    compiled = _kernels.take_decode_outputs(*compiled_side, patch._KINDS, variant)
    twin = _reference.take_decode_outputs(*twin_side, patch._KINDS, variant)
    assert _plain(compiled, compiled_side[0]) == _plain(twin, twin_side[0])


@pytest.mark.parametrize("cls", [Scheduler, AsyncScheduler])
def test_a_plain_decode_is_taken_alike_by_both(cls):
    """The generated states above may all be left to vLLM; these are taken."""
    patch._bind()
    specs = [(3, 7, 1, 1, RequestStatus.RUNNING, 14), (2, 9, 1, 1, RequestStatus.RUNNING, 14)]
    compiled_side, twin_side = (_state(cls, True, specs, True) for _ in range(2))
    compiled = _kernels.take_decode_outputs(*compiled_side, patch._KINDS, VARIANT)
    twin = _reference.take_decode_outputs(*twin_side, patch._KINDS, VARIANT)
    assert compiled is not None and not compiled[1]  # both taken, none left
    assert _plain(compiled, compiled_side[0]) == _plain(twin, twin_side[0])


# Sample logprobs: one step against vLLM's own method.

# Four decodes that do not stop (r0 to r3; r1's stop token is 31).
DECODES = [(3, 7, 1, 1, RequestStatus.RUNNING, 14), (2, 9, 1, 1, RequestStatus.RUNNING, 14),
           (4, 8, 1, 1, RequestStatus.RUNNING, 14), (3, 7, 1, 1, RequestStatus.RUNNING, 14)]
STOPS = [DECODES[0], (2, 31, 1, 1, RequestStatus.RUNNING, 14), DECODES[2],
         (3, 7, 1, 1, RequestStatus.RUNNING, 4)]  # r1 by its stop token, r3 by max_tokens


def _one_step(monkeypatch, implementation, cls, specs, logprobs, runner_logprobs,
              prepare=None, cache_some=True, **state_options):
    """vLLM's method and fastbatch's (with ``implementation``'s call) on the
    same step (``prepare``, if given, called on each side's state first; the
    ``_state`` options given): both sides, their results (or what each raised)."""
    patch._bind()
    monkeypatch.setattr(fastbatch, "take_decode_outputs", implementation.take_decode_outputs)
    monkeypatch.setattr(fastbatch, "merge_decode_outputs",
                        implementation.merge_decode_outputs)
    implementation.reset_stats()
    sides, results = [], []
    for method in (STOCK, patch.update_from_output):
        side = _state(cls, True, specs, cache_some, logprobs, runner_logprobs, **state_options)
        if prepare is not None:
            prepare(*side)
        try:
            results.append(method(*side))
        except Exception as exc:
            results.append(exc)
        sides.append(side)
    return sides, results


@pytest.mark.parametrize("implementation", [_kernels, _reference], ids=["compiled", "twin"])
@pytest.mark.parametrize("cls", [Scheduler, AsyncScheduler])
@pytest.mark.parametrize("runner_logprobs", ["rows", "cu", "none"])
@pytest.mark.parametrize("logprobs", [(1, 0, 5, -1), (None, 1, None, 5), (0, None, -1, None)],
                         ids=lambda value: "-".join(map(str, value)))
def test_logprob_requests_are_taken_as_vllm_slices_them(monkeypatch, implementation, cls,
                                                         runner_logprobs, logprobs):
    (stock, fast), (stock_result, fast_result) = _one_step(
        monkeypatch, implementation, cls, DECODES, logprobs, runner_logprobs)
    assert (_stand_ins.side_state(fast[0], fast_result)
            == _stand_ins.side_state(stock[0], stock_result))
    assert implementation.update_from_output.stats() == {"fast_outputs": 4,
                                                         "stock_outputs": 0}
    runner = fast[2]
    outputs = {output.request_id: output for output in fast_result[0].outputs}
    for rid, value in zip(("r0", "r1", "r2", "r3"), logprobs, strict=True):
        new_logprobs = outputs[rid].new_logprobs
        if value is None or runner.logprobs is None:
            assert new_logprobs is None
        else:  # views of the runner's very arrays, as slice_request makes them
            assert_same_slice(new_logprobs, runner.logprobs.slice_request(
                row_of(runner, rid), 1))


@pytest.mark.parametrize("implementation", [_kernels, _reference], ids=["compiled", "twin"])
@pytest.mark.parametrize("runner_logprobs", ["rows", "cu", "none"])
def test_logprob_requests_that_stop_go_to_vllm(monkeypatch, implementation, runner_logprobs):
    (stock, fast), (stock_result, fast_result) = _one_step(
        monkeypatch, implementation, AsyncScheduler, STOPS, (1, 5, None, -1), runner_logprobs)
    assert (_stand_ins.side_state(fast[0], fast_result)
            == _stand_ins.side_state(stock[0], stock_result))
    assert implementation.update_from_output.stats() == {"fast_outputs": 2,
                                                         "stock_outputs": 2}
    stopped = [output for output in fast_result[0].outputs if output.finish_reason is not None]
    assert [output.request_id for output in stopped] == ["r1", "r3"]
    assert all((output.new_logprobs is None) == (runner_logprobs == "none")
               for output in stopped)


@pytest.mark.parametrize("implementation", [_kernels, _reference], ids=["compiled", "twin"])
@pytest.mark.parametrize("cls", [Scheduler, AsyncScheduler])
def test_structured_output_requests_go_to_vllm(monkeypatch, implementation, cls):
    """A request with a grammar (r0, r2) is left to vLLM's loop, whose
    ``accept_tokens`` advances it; the others are taken; the step is stock's,
    and the grammar sees each token once."""
    advanced = []

    def with_grammars(scheduler, *_):
        grammar, accepted = object(), []
        for request_id in ("r0", "r2"):
            scheduler.requests[request_id].structured_output_request = grammar

        def accept_tokens(request, tokens):
            if request.structured_output_request is grammar:
                accepted.append((request.request_id, list(tokens)))
            return True

        scheduler.structured_output_manager = SimpleNamespace(accept_tokens=accept_tokens)
        advanced.append(accepted)

    (stock, fast), (stock_result, fast_result) = _one_step(
        monkeypatch, implementation, cls, DECODES, None, "none", with_grammars)
    assert (_stand_ins.side_state(fast[0], fast_result)
            == _stand_ins.side_state(stock[0], stock_result))
    assert advanced[1] == advanced[0] and [rid for rid, _ in advanced[0]] == ["r0", "r2"]
    assert implementation.update_from_output.stats() == {"fast_outputs": 2,
                                                         "stock_outputs": 2}


def _same_step(stock, fast, stock_result, fast_result):
    """Both sides ended alike: the same error, or the same outputs and state."""
    if isinstance(stock_result, Exception) or isinstance(fast_result, Exception):
        assert type(fast_result) is type(stock_result), (stock_result, fast_result)
        assert str(fast_result) == str(stock_result)
    else:
        assert _side_state(fast[0], fast_result) == _side_state(stock[0], stock_result)


def _side_state(scheduler, result):
    """``_stand_ins.side_state`` of a scheduler that may lack some of its state
    (a Mock or nothing in its place: compared as the same stand-in)."""
    view = copy.copy(scheduler)
    if type(getattr(view, "running", None)) is not list:
        view.running = []
    if type(getattr(view, "kv_cache_manager", None)) is not type(lockstep_manager()):
        view.kv_cache_manager = lockstep_manager()
    return _stand_ins.side_state(view, result)


def lockstep_manager():
    return _stand_ins.small_manager(False)


# Decodes with and without placeholders (r1, r3: none; then vLLM 0.33+ reads
# num_spec_tokens, and 0.34 the Mamba rule) and two that stop (r2, r3).
MIXED = [(3, 7, 1, 1, RequestStatus.RUNNING, 14), (2, 9, 1, 0, RequestStatus.RUNNING, 14),
         (2, 31, 1, 1, RequestStatus.RUNNING, 14), (3, 7, 1, 0, RequestStatus.RUNNING, 4)]


@pytest.mark.parametrize("implementation", [_kernels, _reference], ids=["compiled", "twin"])
@pytest.mark.parametrize("specs", [DECODES, MIXED], ids=["decodes", "mixed"])
@pytest.mark.parametrize("cls", [Scheduler, AsyncScheduler])
def test_scheduler_state_read_only_on_some_path(monkeypatch, implementation, cls, specs):
    """Issue 52: vLLM's own tests build a scheduler with ``object.__new__`` and
    set only what vLLM's method reads on their path.  With any one attribute
    of the stand-in scheduler missing, fastbatch ends as vLLM does: the same
    outputs and state where vLLM's method runs through (then fastbatch must
    not read it, or must take vLLM's path), the same error where it raises."""
    names = sorted(vars(_state(cls, True, specs, True)[0]))
    assert "num_sampled_tokens_per_step" in names and "structured_output_manager" in names
    passed_stock = []
    for name in names:
        def without(scheduler, *_, name=name):
            delattr(scheduler, name)

        (stock, fast), (stock_result, fast_result) = _one_step(
            monkeypatch, implementation, cls, specs, None, "none", without)
        try:
            _same_step(stock, fast, stock_result, fast_result)
        except AssertionError as exc:
            raise AssertionError(f"without {name}: {exc}") from exc
        if not isinstance(stock_result, Exception):
            passed_stock.append(name)
    # vLLM's method reads these only on paths these steps do not take.
    assert "num_sampled_tokens_per_step" in passed_stock
    assert ("running" in passed_stock) == (specs is DECODES)  # read when a request stops


def test_a_stand_in_scheduler_as_vllms_own_tests_build_it(monkeypatch):
    """Issue 52's case (vLLM's ``test_abort_request_when_structured_output_fsm_cannot_advance``):
    a scheduler built with ``object.__new__``, with no
    ``num_sampled_tokens_per_step``, a Mock for the structured-output manager
    and the KV-cache manager; a plain decode: fastbatch ends as vLLM does."""
    from unittest.mock import Mock

    def as_vllms_test_builds_it(scheduler, *_):
        request = scheduler.requests["r0"]
        state = vars(scheduler)
        for name in list(state):
            if name not in ("requests", "running", "max_model_len", "finished_req_ids",
                            "finished_req_ids_dict", "recompute_kv_load_failures",
                            "perf_metrics", "connector", "ec_connector",
                            "aux_output_connector", "return_sampling_mask", "defer_block_free",
                            "grammar_compile_error_reqs", "encoder_cache_mismatch_reqs",
                            "is_mm_encoder_only", "num_spec_tokens", "has_mamba_layers",
                            "vllm_config"):
                del state[name]
        request.structured_output_request = SimpleNamespace(grammar=Mock())
        scheduler.structured_output_manager = Mock()
        scheduler.structured_output_manager.accept_tokens.return_value = False
        scheduler.kv_cache_manager = Mock()
        scheduler.kv_cache_manager.take_events.return_value = None
        scheduler.kv_event_publisher = Mock()
        scheduler.make_stats = Mock(return_value=None)
        scheduler.waiting = scheduler.kv_holding_waiting = scheduler.async_kv_waiting = Mock()
        scheduler.deferred_waiting = set()
        scheduler._free_request = Mock(return_value=(None, None))

    (stock, fast), (stock_result, fast_result) = _one_step(
        monkeypatch, _kernels, Scheduler, DECODES[:1], None, "none", as_vllms_test_builds_it)
    assert not isinstance(stock_result, Exception), stock_result
    assert stock[0].requests["r0"].status == RequestStatus.FINISHED_ERROR
    _same_step(stock, fast, stock_result, fast_result)


@pytest.mark.parametrize("implementation", [_kernels, _reference], ids=["compiled", "twin"])
@pytest.mark.parametrize("cls", [Scheduler, AsyncScheduler])
@pytest.mark.parametrize("token", [7, 2**31 - 1, 2**31, -(2**31) - 1])
def test_token_ids_in_an_int32_array(monkeypatch, implementation, cls, token):
    """``_all_token_ids`` an ``array('i')`` subclass (vLLM 0.34.0's TokenBuffer
    is one; here a local one on any release): the tokens appended as vLLM
    appends them; one that does not fit a C int goes to vLLM's loop (whose
    append raises OverflowError)."""
    specs = [DECODES[0], (2, token, 1, 1, RequestStatus.RUNNING, 14), DECODES[2]]
    (stock, fast), (stock_result, fast_result) = _one_step(
        monkeypatch, implementation, cls, specs, None, "none", token_store=Int32Tokens)
    _same_step(stock, fast, stock_result, fast_result)
    fits = -(2**31) <= token < 2**31
    assert isinstance(stock_result, OverflowError) == (not fits)
    assert implementation.update_from_output.stats()["fast_outputs"] == (3 if fits else 2)
    if fits:
        for rid, request in fast[0].requests.items():
            assert type(request._all_token_ids) is Int32Tokens
            assert list(request._all_token_ids) == list(stock[0].requests[rid]._all_token_ids)


class _OwnAppend(Int32Tokens):
    __slots__ = ()

    def append(self, token):
        array.append(self, token)


@pytest.mark.parametrize("implementation", [_kernels, _reference], ids=["compiled", "twin"])
def test_an_array_type_with_its_own_append_goes_to_vllm(monkeypatch, implementation):
    (stock, fast), (stock_result, fast_result) = _one_step(
        monkeypatch, implementation, Scheduler, DECODES, None, "none", token_store=_OwnAppend)
    _same_step(stock, fast, stock_result, fast_result)
    assert implementation.update_from_output.stats()["fast_outputs"] == 0


@pytest.mark.parametrize("implementation", [_kernels, _reference], ids=["compiled", "twin"])
@pytest.mark.parametrize("cls", [Scheduler, AsyncScheduler])
@pytest.mark.parametrize("runner_logprobs", ["rows", "cu", "none"])
def test_runner_rows_out_of_scheduling_order(monkeypatch, implementation, cls,
                                             runner_logprobs):
    """The runner's rows in another order than the scheduler's (vLLM 0.34.0's
    model runner lists its batch, not num_scheduled_tokens): each request's
    row, and its sample logprobs, are found as vLLM finds them."""
    (stock, fast), (stock_result, fast_result) = _one_step(
        monkeypatch, implementation, cls, DECODES, (1, None, 5, -1), runner_logprobs,
        reverse_rows=True)
    _same_step(stock, fast, stock_result, fast_result)
    assert implementation.update_from_output.stats() == {"fast_outputs": 4,
                                                         "stock_outputs": 0}


@pytest.mark.parametrize("implementation", [_kernels, _reference], ids=["compiled", "twin"])
def test_an_id_listed_twice_gets_the_row_vllm_reads(monkeypatch, implementation):
    """vLLM 0.34.0 maps each id of req_ids to its last position (its dict);
    before it, req_id_to_index says the row: r1's row is its second listing."""

    def listed_twice(scheduler, scheduler_output, runner_output):
        runner_output.req_ids.append("r1")
        runner_output.sampled_token_ids.append([11])
        if not ROWS_FROM_REQ_IDS:
            runner_output.req_id_to_index["r1"] = len(runner_output.req_ids) - 1

    (stock, fast), (stock_result, fast_result) = _one_step(
        monkeypatch, implementation, Scheduler, DECODES, None, "none", listed_twice)
    _same_step(stock, fast, stock_result, fast_result)
    assert list(fast[0].requests["r1"]._output_token_ids)[-1] == 11
    assert implementation.update_from_output.stats()["fast_outputs"] == 4


MAMBA_CASES = [(True, False, True), (True, True, True), (True, False, False),
               (False, False, True), ("missing", False, True)]


def _with_mamba(scheduler, mamba, asynchronous, prefix_caching):
    if mamba == "missing":
        del scheduler.has_mamba_layers
    else:
        scheduler.has_mamba_layers = mamba
        scheduler.scheduler_config = SimpleNamespace(async_scheduling=asynchronous)
        scheduler.cache_config = SimpleNamespace(enable_prefix_caching=prefix_caching)


# No placeholders (else vLLM caches anyway), no block filled.
UNPLACED = [(2, 7, 1, 0, RequestStatus.RUNNING, 14), (2, 9, 1, 0, RequestStatus.RUNNING, 14)]


@pytest.mark.parametrize("implementation", [_kernels, _reference], ids=["compiled", "twin"])
@pytest.mark.parametrize(("mamba", "asynchronous", "prefix_caching"), MAMBA_CASES)
def test_mamba_caching_rule_against_vllm(monkeypatch, implementation, mamba, asynchronous,
                                         prefix_caching):
    """vLLM 0.34.0 also caches the blocks of a request without placeholders
    where the model has Mamba layers, scheduling is sync and prefix caching
    on; older releases never read it (the same steps are their
    counterpart).  A scheduler without ``has_mamba_layers``: vLLM 0.34.0
    raises reading it, and fastbatch the same; older releases do not."""
    (stock, fast), (stock_result, fast_result) = _one_step(
        monkeypatch, implementation, Scheduler, UNPLACED, None, "none",
        lambda scheduler, *_: _with_mamba(scheduler, mamba, asynchronous, prefix_caching))
    _same_step(stock, fast, stock_result, fast_result)
    if ROWS_FROM_REQ_IDS and mamba == "missing":
        assert isinstance(stock_result, AttributeError)
    else:  # (a decode's cache call is a no-op here: taken)
        assert implementation.update_from_output.stats() == {"fast_outputs": 2,
                                                             "stock_outputs": 0}


@pytest.mark.parametrize(("mamba", "asynchronous", "prefix_caching"), MAMBA_CASES)
def test_mamba_caching_rule_compiled_matches_twin(mamba, asynchronous, prefix_caching):
    """Variant 3 (vLLM 0.34.0's rule) with blocks left to cache (the cached
    counts lowered: neither calls the KV-cache manager): the requests go to
    vLLM's loop exactly where the rule applies, or cannot be read."""
    patch._bind()
    results = []
    for implementation in (_kernels, _reference):
        state = _state(Scheduler, True, UNPLACED, True)
        _with_mamba(state[0], mamba, asynchronous, prefix_caching)
        single = state[0].kv_cache_manager.coordinator.single_type_managers[0]
        single.num_cached_block.update(dict.fromkeys(single.num_cached_block, 0))
        result = implementation.take_decode_outputs(*state, patch._KINDS, 3)
        results.append(_plain(result, state[0]))
    assert results[0] == results[1]
    applies = mamba == "missing" or (mamba is True and not asynchronous and prefix_caching)
    assert (results[0][0] is None) == applies


@pytest.mark.parametrize("implementation", [_kernels, _reference], ids=["compiled", "twin"])
@pytest.mark.parametrize("runner_logprobs", ["cu-short", "cu-not-int", "tuple", "lists", "0-d"])
def test_logprobs_the_fast_path_cannot_slice_go_to_vllm(monkeypatch, implementation,
                                                        runner_logprobs):
    """vLLM's loop takes them: its result, or its error (the same one)."""
    (stock, fast), (stock_result, fast_result) = _one_step(
        monkeypatch, implementation, Scheduler, DECODES, (None, 1, 5, -1), runner_logprobs)
    counters = implementation.update_from_output.stats()
    if isinstance(stock_result, Exception):
        assert type(fast_result) is type(stock_result)
        assert str(fast_result) == str(stock_result)
    else:
        assert _stand_ins.side_state(fast[0], fast_result) == _stand_ins.side_state(stock[0],
                                                                            stock_result)
    left = 1 if runner_logprobs in ("cu-short", "cu-not-int") else 3
    assert counters == {"fast_outputs": 4 - left, "stock_outputs": left}


def _wrong_logprobs(how):
    """The compiled call, with each sample-logprobs slice it made wrong."""
    real = _kernels.take_decode_outputs

    def wrong(scheduler, scheduler_output, model_runner_output, kinds, variant, *more):
        taken = real(scheduler, scheduler_output, model_runner_output, kinds, variant, *more)
        for slot in taken[0] if taken is not None else ():
            if type(slot) is not str and slot.new_logprobs is not None:
                ids, values, ranks, _ = slot.new_logprobs
                if how == "dtype":  # a (1,) array: == alone would not tell
                    ranks = ranks.astype(numpy.int32)
                elif how == "row":
                    row = row_of(model_runner_output, slot.request_id) + 1
                    ids, values, ranks, _ = model_runner_output.logprobs.slice_request(row, 1)
                else:  # a copy, not a view
                    values = values.copy()
                slot.new_logprobs = LogprobsLists(ids, values, ranks, None)
        return taken

    return wrong


def test_logprobs_lists_is_bound_only_as_the_named_tuple_it_builds():
    from typing import NamedTuple

    patch._bind()
    assert patch._KINDS[8] is LogprobsLists and patch._KINDS[9] is numpy.ndarray

    class Five(NamedTuple):  # a field more: slice_request's code could stay the same
        logprob_token_ids: object
        logprobs: object
        sampled_token_ranks: object
        cu_num_generated_tokens: object = None
        more: object = None

    class Truthy(NamedTuple):
        logprob_token_ids: object
        logprobs: object
        sampled_token_ranks: object
        cu_num_generated_tokens: object = None

        def __len__(self):
            return 0

    assert patch._is_plain_logprobs_lists(LogprobsLists)
    assert not patch._is_plain_logprobs_lists(Five)
    assert not patch._is_plain_logprobs_lists(Truthy)


@pytest.mark.parametrize("how", ["dtype", "row"])
def test_activation_check_refuses_wrong_logprobs(monkeypatch, how):
    assert patch.activation_check(STOCK, patch.update_from_output) is None
    monkeypatch.setattr(fastbatch, "take_decode_outputs", _wrong_logprobs(how))
    problem = patch.activation_check(STOCK, patch.update_from_output)
    assert problem is not None and "new_logprobs" in problem


def test_the_check_sees_a_copy_for_a_view(monkeypatch):
    """A copy has the same values, dtype and shape: only the views check tells."""
    patch._bind()
    monkeypatch.setattr(fastbatch, "take_decode_outputs", _wrong_logprobs("copy"))
    fast = _state(Scheduler, True, DECODES, True, (1, 0, 5, -1), "rows")
    result = patch.update_from_output(*fast)
    output = result[0].outputs[0]
    expected = fast[2].logprobs.slice_request(0, 1)
    assert _compare.plain(output.new_logprobs) == _compare.plain(expected)
    with pytest.raises(AssertionError):
        assert_same_slice(output.new_logprobs, expected)


@pytest.mark.parametrize("implementation", [_kernels, _reference], ids=["compiled", "twin"])
def test_merge(implementation):
    first, third = SimpleNamespace(request_id="a"), SimpleNamespace(request_id="c")
    error = SimpleNamespace(request_id="b")
    own = SimpleNamespace(request_id="x")
    merged = implementation.merge_decode_outputs(["a", own, "b", "c"], [first, third, error])
    assert merged == [first, own, third, error]
    assert implementation.merge_decode_outputs([own], []) == [own]


@pytest.mark.parametrize("implementation", [_kernels, _reference], ids=["compiled", "twin"])
def test_bad_input_changes_nothing(implementation):
    patch._bind()
    specs = [(3, 7, 1, 1, RequestStatus.RUNNING, 14)]
    scheduler, scheduler_output, runner_output = _state(AsyncScheduler, True, specs, False,
                                                        index_map=True)
    before = _plain(None, scheduler)
    with pytest.raises(ValueError, match="kinds must have 10 items"):
        implementation.take_decode_outputs(scheduler, scheduler_output, runner_output,
                                           patch._KINDS[:9], 0)
    with pytest.raises(ValueError, match="8-item EngineCoreOutput template"):
        implementation.take_decode_outputs(scheduler, scheduler_output, runner_output,
                                           (*patch._KINDS[:7], (), *patch._KINDS[8:]), 0)
    with pytest.raises(ValueError, match=r"kinds\[8\] must be LogprobsLists"):
        implementation.take_decode_outputs(scheduler, scheduler_output, runner_output,
                                           (*patch._KINDS[:8], list, *patch._KINDS[9:]), 0)
    scheduler_output.num_scheduled_tokens = list(scheduler_output.num_scheduled_tokens)
    with pytest.raises(TypeError, match="num_scheduled_tokens must be a dict"):
        implementation.take_decode_outputs(scheduler, scheduler_output, runner_output,
                                           patch._KINDS, 0)
    scheduler_output.num_scheduled_tokens = {"r0": 1}
    runner_output.sampled_token_ids = tuple(runner_output.sampled_token_ids)
    with pytest.raises(TypeError, match="sampled_token_ids must be a list"):
        implementation.take_decode_outputs(scheduler, scheduler_output, runner_output,
                                           patch._KINDS, 0)
    runner_output.sampled_token_ids = list(runner_output.sampled_token_ids)
    with pytest.raises(ValueError, match="variant must be 0, 1, 2 or 3"):
        implementation.take_decode_outputs(scheduler, scheduler_output, runner_output,
                                           patch._KINDS, 7)
    for accept, refused in ((lambda request, tokens: True, None), ("accept", [])):
        with pytest.raises(TypeError, match="accept must be callable and come with a refused"):
            implementation.take_decode_outputs(scheduler, scheduler_output, runner_output,
                                               patch._KINDS, 0, False, accept, refused)
    assert _plain(None, scheduler) == before
    # A count that is not a positive int, a token that is not an int: vLLM's loop.
    scheduler_output.num_scheduled_tokens = {"r0": 1.0}
    assert implementation.take_decode_outputs(scheduler, scheduler_output, runner_output,
                                              patch._KINDS, 0) is None
    scheduler_output.num_scheduled_tokens = {"r0": 1}
    runner_output.sampled_token_ids = [[7.0]]
    assert implementation.take_decode_outputs(scheduler, scheduler_output, runner_output,
                                              patch._KINDS, 0) is None
    # A request id that is not a str: the whole step is vLLM's.
    runner_output.sampled_token_ids = [[7]]
    scheduler_output.num_scheduled_tokens = {"r0": 1, 5: 1}
    assert implementation.take_decode_outputs(scheduler, scheduler_output, runner_output,
                                              patch._KINDS, 0) is None
    # Variant 3 (vLLM 0.34): req_ids must be a list; an id that cannot be a
    # dict key (vLLM's dict raises) leaves the step to vLLM.
    scheduler_output.num_scheduled_tokens = {"r0": 1}
    runner_output.req_ids = ("r0",)
    with pytest.raises(TypeError, match="req_ids must be a list"):
        implementation.take_decode_outputs(scheduler, scheduler_output, runner_output,
                                           patch._KINDS, 3)
    runner_output.req_ids = [["r0"]]
    assert implementation.take_decode_outputs(scheduler, scheduler_output, runner_output,
                                              patch._KINDS, 3) is None
    assert _plain(None, scheduler) == before


class _NotExactlyRequest(Request):
    """A subclass: the fast path leaves it to vLLM's loop."""


def _long_batch(cls):
    """150 decodes, longer than the compiled call's prefetch pipeline (32
    requests ahead, in a ring of 64): every 7th unknown to the scheduler,
    every 11th from 3 on a subclass of Request.  Returns the state and the Requests."""
    requests = []
    for index in range(150):
        request = copy.deepcopy(_stand_ins.stand_in_requests()[0])
        request.request_id = f"r{index}"
        requests.append(request)
    specs = [(3, 7, 1, 1, RequestStatus.RUNNING, 10**6)] * len(requests)
    state = _state(cls, False, specs, False, requests=requests)
    for index in range(0, len(requests), 7):
        del state[0].requests[f"r{index}"]
    for index in range(3, len(requests), 11):
        requests[index].__class__ = _NotExactlyRequest
    return state, [r for r in state[0].requests.values() if type(r) is Request]


@pytest.mark.parametrize("cls", [Scheduler, AsyncScheduler])
def test_batches_longer_than_the_prefetch_pipeline(cls):
    patch._bind()
    compiled_side, requests = _long_batch(cls)
    twin_side, _ = _long_batch(cls)
    compiled = _kernels.take_decode_outputs(*compiled_side, patch._KINDS, VARIANT)
    twin = _reference.take_decode_outputs(*twin_side, patch._KINDS, VARIANT)
    assert _plain(compiled, compiled_side[0]) == _plain(twin, twin_side[0])
    assert len(compiled[1]) == 150 - len(requests)  # every Request known is taken

    def step():
        assert _kernels.take_decode_outputs(*compiled_side, patch._KINDS, VARIANT) is not None
        for request in requests:
            _undo_decode(request)

    for request in requests:
        _undo_decode(request)
    step()
    # The prefetch holds each request and its instance dict for a while.
    assert_no_leak(step, [*requests, *map(vars, requests)], 200)


def _undo_decode(request):
    """The request as before a decode step that took it (one token in flight)."""
    del request._output_token_ids[-1]
    del request._all_token_ids[-1]
    request.num_in_flight_tokens = 1
    request.num_output_placeholders = 1


@pytest.mark.parametrize(("runner_logprobs", "variant", "reverse_rows"),
                         [("none", VARIANT, False), ("cu", VARIANT, False), ("none", 3, True)])
def test_no_leaks(runner_logprobs, variant, reverse_rows):
    """(variant 3 with the rows reversed: the index built from req_ids)"""
    patch._bind()
    specs = [(3, 7, 1, 1, RequestStatus.RUNNING, 10**6)] * 3  # logprobs None, 1 and 0
    scheduler, scheduler_output, runner_output = _state(AsyncScheduler, False, specs, False,
                                                        runner_logprobs=runner_logprobs,
                                                        reverse_rows=reverse_rows)
    requests = list(scheduler.requests.values())

    def step():
        result = _kernels.take_decode_outputs(scheduler, scheduler_output, runner_output,
                                              patch._KINDS, variant)
        assert result is not None
        for request in requests:  # undo the step, so that every call takes all
            _undo_decode(request)

    for _ in range(100):
        step()
    arrays = [] if runner_output.logprobs is None else [
        array.base if array.base is not None else array for array in runner_output.logprobs[:3]]
    assert_no_leak(step, [scheduler, scheduler_output, runner_output, *requests,
                          patch._KINDS, *arrays], 2000)


def test_no_leaks_with_grammars():
    """Requests with a grammar: r0 taken, r1 left (its token fills a block),
    r2 refused (put back, and the requests left rebuilt in order)."""
    patch._bind()
    specs = [(3, 7, 1, 1, RequestStatus.RUNNING, 10**6)] * 3
    scheduler, scheduler_output, runner_output = _state(AsyncScheduler, False, specs, False)
    requests = list(scheduler.requests.values())
    grammar = SimpleNamespace()
    for request in requests:
        request.structured_output_request = grammar

    def accept(request, tokens):
        return request is not requests[2]

    def step():
        refused = []
        result = _kernels.take_decode_outputs(scheduler, scheduler_output, runner_output,
                                              patch._KINDS, VARIANT, False, accept, refused)
        assert result is not None and refused == ["r2"] and list(result[1]) == ["r1", "r2"]
        _undo_decode(requests[0])  # the one taken

    for _ in range(100):
        step()
    assert_no_leak(step, [scheduler, scheduler_output, runner_output, *requests,
                          patch._KINDS, grammar], 2000)


def test_guard_accepts_this_vllm_and_refuses_a_changed_method():
    import vllm

    assert patch.PATCH.check_target(vllm.__version__, STOCK) is None
    assert "not a verified variant" in patch.PATCH.check_target(vllm.__version__, make_fast)
    assert "not a verified version" in patch.PATCH.check_target("0.20.0", STOCK)


def test_activation_check_passes_and_refuses_a_wrong_kernel(monkeypatch):
    assert patch.activation_check(STOCK, patch.update_from_output) is None

    def off_by_one(*args):
        taken = _kernels.take_decode_outputs(*args)
        for request in args[0].requests.values():
            request.num_in_flight_tokens += 1
        return taken

    monkeypatch.setattr(fastbatch, "take_decode_outputs", off_by_one)
    assert patch.activation_check(STOCK, patch.update_from_output) is not None
    monkeypatch.setattr(fastbatch, "take_decode_outputs", _kernels.take_decode_outputs)
    if ROWS_FROM_REQ_IDS:
        # vLLM 0.34.0: the rows read from req_ids in scheduling order, not
        # where the runner put them (the check reverses them every other step).
        def by_position(scheduler, scheduler_output, runner_output, *more):
            runner_output = copy.copy(runner_output)
            runner_output.req_ids = list(scheduler_output.num_scheduled_tokens)
            return _kernels.take_decode_outputs(scheduler, scheduler_output, runner_output,
                                                *more)

        monkeypatch.setattr(fastbatch, "take_decode_outputs", by_position)
        assert patch.activation_check(STOCK, patch.update_from_output) is not None
    else:
        monkeypatch.setattr(patch, "_variant", lambda scheduler: 2)  # the wrong placeholder rule
        assert "AsyncScheduler" in patch.activation_check(STOCK, patch.update_from_output)


def test_activation_check_refuses_a_kernel_that_takes_nothing(monkeypatch):
    """A kernel that hands every request back to vLLM gives stock's results:
    the check fails all the same, saying so."""
    monkeypatch.setattr(fastbatch, "take_decode_outputs", lambda *args: None)
    problem = patch.activation_check(STOCK, patch.update_from_output)
    assert problem is not None and "took no request" in problem


def test_plugin_applies_and_reverts(monkeypatch):
    piece = registry.piece("update_from_output")
    assert piece.patches == (patch.PATCH,)
    monkeypatch.setenv("FASTBATCH", "1")
    monkeypatch.setenv("FASTBATCH_DISABLE",
                       "async_output_token_ids async_spec_token_ids penalty_output_tokens")
    try:
        vllm_plugin.register()
        assert piece.is_applied() and Scheduler.update_from_output is patch.update_from_output
        assert AsyncScheduler.update_from_output is patch.update_from_output
        assert vllm_plugin.status()["patches"]["update_from_output"] is True
    finally:
        vllm_plugin.revert()
    assert Scheduler.update_from_output is STOCK
    assert not piece.is_applied()
    monkeypatch.setenv("FASTBATCH_DISABLE", "update_from_output")
    try:
        vllm_plugin.register()
        assert Scheduler.update_from_output is STOCK
        assert vllm_plugin.status()["patches"]["update_from_output"] is False
    finally:
        vllm_plugin.revert()



# FASTBATCH_VERIFY: the shadow check, with the piece installed as the plugin
# installs it (class attribute, every call checked); the lockstep's stock side
# gets vLLM's own method back on its instance.

@pytest.fixture
def verified(monkeypatch, tmp_path):
    """The piece applied under FASTBATCH_VERIFY=1, reproducers in ``tmp_path``."""
    monkeypatch.setenv("FASTBATCH_VERIFY_DIR", str(tmp_path))
    assert patch.PATCH.apply(verify=1.0)
    assert Scheduler.update_from_output is not patch.update_from_output  # the checked one
    yield tmp_path
    patch.PATCH.revert()
    assert Scheduler.update_from_output is STOCK


def verified_lockstep(workload, seed):
    harness = lockstep.Lockstep(workload, seed=seed)
    harness.stock.update_from_output = MethodType(STOCK, harness.stock)
    return harness


@pytest.mark.parametrize("workload", (*lockstep.WORKLOADS, lockstep.SPEC_WORKLOADS[0],
                                      lockstep.SPEC_WORKLOADS[-1], *STATS_WORKLOADS),
                         ids=lambda w: w.name)
def test_verify_no_false_divergence_in_lockstep(verified, workload):
    _kernels.reset_stats()
    harness = verified_lockstep(workload, seed=13)
    harness.run(STEPS_PER_WORKLOAD)  # raises Divergence at the first difference
    assert patch.PATCH.checked > 0
    assert patch.PATCH.divergences == 0 and patch.PATCH.reproducers == []
    assert fastbatch.stats()["update_from_output"]["fast_outputs"] > 0
    assert not list(verified.iterdir())


def plant(monkeypatch, after_calls, where):
    """The compiled call, wrong after ``after_calls`` calls for taken requests
    whose id ends in "7" (its token lists get a wrong last token): the
    activation check (which ran at apply) cannot see it."""
    real = _kernels.take_decode_outputs
    calls, fired = [0], []

    def buggy(scheduler, scheduler_output, model_runner_output, kinds, variant, *more):
        taken = real(scheduler, scheduler_output, model_runner_output, kinds, variant, *more)
        calls[0] += 1
        if taken is not None and calls[0] > after_calls:
            for slot in taken[0]:
                if type(slot) is not str and slot.request_id.endswith("7"):
                    request = scheduler.requests[slot.request_id]
                    if where == "lists":
                        request._output_token_ids[-1] += 1
                        request._all_token_ids[-1] = request._output_token_ids[-1]
                    else:  # the output
                        slot.new_token_ids = [slot.new_token_ids[0] + 1]
                    fired.append(slot.request_id)
        return taken

    monkeypatch.setattr(fastbatch, "take_decode_outputs", buggy)
    return fired


@pytest.mark.parametrize("where", ["lists", "output"])
@pytest.mark.parametrize("workload", [lockstep.WORKLOADS[3], lockstep.WORKLOADS[2]],
                         ids=lambda w: w.name)
def test_verify_catches_a_planted_bug_and_leaves_stock_state(verified, monkeypatch, logs,
                                                               workload, where):
    import vllm

    fired = plant(monkeypatch, 20, where)
    harness = verified_lockstep(workload, seed=21)
    fast_outputs = []
    for _ in range(120):
        # The lockstep compares outputs and the whole scheduler state with
        # stock's after every step: the call that diverged included.
        harness.step()
        fast_outputs.append(fastbatch.stats()["update_from_output"]["fast_outputs"])
        if patch.PATCH.divergences:
            break
    assert fired and patch.PATCH.divergences == 1
    checked = patch.PATCH.checked
    assert checked > 20
    harness.run(40)  # vLLM's method from now on, equal to stock's
    assert patch.PATCH.checked == checked and patch.PATCH.divergences == 1
    assert fastbatch.stats()["update_from_output"]["fast_outputs"] == fast_outputs[-1]
    [path] = patch.PATCH.reproducers
    assert os.path.dirname(path) == str(verified)
    assert any("diverged from vLLM" in line and fired[0] in line
               for line in logs.at(logging.ERROR))
    problem = vllm_plugin.replay(path)
    assert problem is not None and fired[0] in problem
    monkeypatch.setattr(fastbatch, "take_decode_outputs", _kernels.take_decode_outputs)
    assert vllm_plugin.replay(path) is None
    assert vllm.__version__


@pytest.mark.parametrize("workload", lockstep.LOGPROB_WORKLOADS[:2], ids=lambda w: w.name)
def test_verify_no_false_divergence_with_logprobs(verified, monkeypatch, workload):
    harness = verified_lockstep(workload, seed=13)
    taken = counting_logprob_takes(monkeypatch, _kernels)
    harness.run(80)
    assert patch.PATCH.checked > 0
    assert patch.PATCH.divergences == 0 and patch.PATCH.reproducers == []
    assert_took_logprob_requests(workload, taken)
    assert not list(verified.iterdir())


@pytest.mark.parametrize("how", ["dtype", "row"])
def test_verify_catches_wrong_logprobs_and_leaves_stock_state(verified, monkeypatch, how):
    """A wrong slice (another row; a (1,) array of another dtype, which
    ``==`` would pass): caught, undone, reproduced."""
    harness = verified_lockstep(lockstep.LOGPROB_WORKLOADS[0], seed=21)
    monkeypatch.setattr(fastbatch, "take_decode_outputs", _wrong_logprobs(how))
    for _ in range(60):
        harness.step()  # the lockstep compares with stock's after each step
        if patch.PATCH.divergences:
            break
    assert patch.PATCH.divergences == 1
    harness.run(20)  # vLLM's method from now on
    [path] = patch.PATCH.reproducers
    problem = vllm_plugin.replay(path)
    assert problem is not None and "new_logprobs" in problem
    monkeypatch.setattr(fastbatch, "take_decode_outputs", _kernels.take_decode_outputs)
    assert vllm_plugin.replay(path) is None


def test_verify_restores_the_order_of_a_wrong_merge(verified, monkeypatch):
    """A merge that puts the outputs out of vLLM's order: front-end 0's
    outputs are put back in order (the lockstep compares them)."""
    real = _kernels.merge_decode_outputs
    monkeypatch.setattr(fastbatch, "merge_decode_outputs",
                        lambda slots, stock: real(slots, stock)[::-1])
    harness = verified_lockstep(lockstep.WORKLOADS[2], seed=3)
    harness.run(30)
    assert patch.PATCH.divergences == 1


@pytest.mark.parametrize("workload", lockstep.GRAMMAR_WORKLOADS[:3], ids=lambda w: w.name)
def test_verify_no_false_divergence_with_grammars(verified, monkeypatch, workload):
    """The shadow's vLLM method gets the grammars' answers as they were given
    to the compiled call (asked again, a grammar would advance twice)."""
    harness = verified_lockstep(workload, seed=23)
    counts = counting_grammar_takes(monkeypatch, _kernels)
    harness.run(100)
    assert patch.PATCH.checked > 0
    assert patch.PATCH.divergences == 0 and patch.PATCH.reproducers == []
    assert counts["taken"] > 0 and counts["refused"] > 0, counts
    assert not list(verified.iterdir())


def _grammar_planted(how):
    """The compiled call with its grammar calls wrong: "skipped" (a grammar is
    never asked) or "ignored" (a refusal is taken as an acceptance)."""
    real = _kernels.take_decode_outputs

    def wrong(scheduler, scheduler_output, model_runner_output, kinds, variant, drafts=False,
              accept=None, refused=None):
        if accept is not None:
            asked = accept
            accept = ((lambda request, tokens: True) if how == "skipped"
                      else (lambda request, tokens: asked(request, tokens) or True))
        return real(scheduler, scheduler_output, model_runner_output, kinds, variant, drafts,
                    accept, refused)

    return wrong


@pytest.mark.parametrize("how", ["skipped", "ignored"])
def test_verify_catches_wrong_grammar_calls_and_leaves_stock_state(verified, monkeypatch, how):
    """A grammar not asked, or a refusal ignored: the shadow sees the
    difference, and vLLM's method takes the step with each grammar asked
    once (the lockstep compares every grammar's tokens with stock's)."""
    monkeypatch.setattr(fastbatch, "take_decode_outputs", _grammar_planted(how))
    harness = verified_lockstep(lockstep.GRAMMAR_WORKLOADS[1], seed=23)
    harness.run(100)
    assert patch.PATCH.divergences == 1 and len(patch.PATCH.reproducers) == 1
    assert vllm_plugin.replay(patch.PATCH.reproducers[0]) is not None
    monkeypatch.setattr(fastbatch, "take_decode_outputs", _kernels.take_decode_outputs)
    assert vllm_plugin.replay(patch.PATCH.reproducers[0]) is None


def test_verify_sampled_checks_some_calls(monkeypatch, tmp_path):
    monkeypatch.setenv("FASTBATCH_VERIFY_DIR", str(tmp_path))
    patch._bind()
    for rate, low, high in ((0.5, 1, 79), (0.0, 0, 0)):
        checked = _verify.checked_replacement(patch.PATCH, STOCK, rate)
        patch.PATCH.checked = patch.PATCH.divergences = 0

        def make(workload, checked=checked):
            scheduler = lockstep.make_scheduler(workload)
            scheduler.update_from_output = MethodType(checked, scheduler)
            return scheduler

        lockstep.Lockstep(lockstep.WORKLOADS[0], seed=4, make_fast=make).run(80)
        assert low <= patch.PATCH.checked <= high, (rate, patch.PATCH.checked)
        assert patch.PATCH.divergences == 0
    patch.PATCH.checked = 0


def test_verify_catches_a_wrong_draft_count_and_leaves_stock_statistics(verified,
                                                                          monkeypatch, logs):
    """With statistics kept: drafts counted one short for the requests taken
    (what fastbatch hands vLLM's make_spec_decoding_stats) differ from what
    vLLM's loop hands it: caught, the step goes to vLLM's method, and the
    lockstep (which compares each step's SchedulerStats) sees stock's."""
    real = patch.drafts_counted

    def one_short(*args):
        return [(rid, drafts, max(accepted - 1, 0)) for rid, drafts, accepted in real(*args)]

    monkeypatch.setattr(patch, "drafts_counted", one_short)
    harness = verified_lockstep(STATS_WORKLOADS[1], seed=21)
    for _ in range(60):
        harness.step()  # the lockstep compares with stock's after each step
        if patch.PATCH.divergences:
            break
    assert patch.PATCH.divergences == 1
    assert any("drafts_counted" in line for line in logs.at(logging.ERROR))
    harness.run(20)  # vLLM's method from now on
