"""Microbenchmark of one scheduler step of plain decode: stock vs fastbatch.

A real vLLM ``AsyncScheduler`` (no model, see tests/scheduler_lockstep.py)
holds ``requests`` running greedy decodes (prompts of 1 to 64 tokens, blocks
of 16, prefix caching on, vLLM's default); one round is one engine step:
``schedule()`` and ``update_from_output()`` of the step before (async
scheduling's order), one sampled token per request.  About one request in 16
crosses a block boundary in any step, as in a real decode.  Variants:
``stock`` (vLLM's own code) and ``fastbatch`` (the five scheduler pieces bound
on this scheduler: ``schedule_running``, ``allocate_slots``,
``update_from_output``, ``_update_after_schedule``,
``_make_cached_request_data``).  The blocks of 16 tokens are vLLM's GPU
default; the CPU engine's are larger, so block boundaries are rarer there.  Before timing, both
variants run 8 steps side by side from the same start, and their scheduler
outputs, engine-core outputs, KV-cache and request state must be equal, so
``--benchmark-disable`` (CI) still checks them.  As vLLM's EngineCore does
after start-up (``freeze_gc_heap``), the states are moved out of the garbage
collector's reach once built (``gc.freeze``), so collections of the long-lived
requests do not land in random rounds.
"""

from __future__ import annotations

import gc
import random
import time
from types import MethodType
from typing import Any

import pytest
import scheduler_lockstep as lockstep

import fastbatch
from fastbatch.patches import (
    after_schedule,
    allocate_slots,
    cached_requests,
    schedule_running,
    update_from_output,
)

ROUND_BUDGET_S = 1.0
MAX_ROUNDS = 400  # every request stays far below max_model_len
CELLS = (256, 1024)
VARIANTS = ("stock", "fastbatch")


class DecodeState:
    """One scheduler with ``requests`` running decodes, stepped one engine step at a time."""

    def __init__(self, requests: int, variant: str) -> None:
        workload = lockstep.Workload(
            f"bench-{requests}", async_scheduling=True, num_blocks=requests * 40,
            max_num_seqs=requests, max_num_batched_tokens=requests * 64,
            max_model_len=4096)
        self.scheduler = lockstep.make_scheduler(workload)
        if variant == "fastbatch":
            allocate_slots.bind()
            schedule_running.bind()
            scheduler, manager = self.scheduler, self.scheduler.kv_cache_manager
            scheduler.schedule = MethodType(schedule_running.schedule, scheduler)
            manager.allocate_slots = MethodType(allocate_slots.allocate_slots, manager)
            scheduler.update_from_output = MethodType(update_from_output.update_from_output,
                                                      scheduler)
            scheduler._update_after_schedule = MethodType(
                after_schedule._update_after_schedule_async, scheduler)
            scheduler._make_cached_request_data = MethodType(
                cached_requests._make_cached_request_data, scheduler)
        rng = random.Random(0)
        for index in range(requests):
            spec = lockstep.RequestSpec(
                request_id=f"r{index}",
                prompt=tuple(rng.randrange(3, lockstep.VOCAB_SIZE)
                             for _ in range(rng.randint(1, 64))),
                max_tokens=3000, min_tokens=0, stop_token_ids=(), ignore_eos=True)
            self.scheduler.add_request(lockstep.make_request(spec, workload.block_size))
        self.steps = 0
        self.in_flight: Any = None
        for _ in range(3):  # the prefill, then decodes only
            self.step()

    def step(self) -> tuple[Any, Any]:
        """One engine step: schedule, then the previous step's model output."""
        from vllm.v1.outputs import ModelRunnerOutput

        self.steps += 1
        scheduler_output = self.scheduler.schedule()
        req_ids = list(scheduler_output.num_scheduled_tokens)
        requests = self.scheduler.requests
        sampled = [[] if requests[rid].is_prefill_chunk
                   else [3 + (self.steps * 7 + index) % 60]
                   for index, rid in enumerate(req_ids)]
        runner_output = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled)
        result = None
        if self.in_flight is not None:
            result = self.scheduler.update_from_output(*self.in_flight)
        self.in_flight = (scheduler_output, runner_output)
        return scheduler_output, result


@pytest.fixture(scope="module")
def decode_states():
    """``decode_states(requests)``: both variants' states, checked equal over 8
    steps side by side (and the fastbatch one's pieces took requests); one
    cell at a time."""
    current: dict[int, dict[str, DecodeState]] = {}

    def get(requests: int) -> dict[str, DecodeState]:
        if requests not in current:
            current.clear()
            gc.unfreeze()
            fastbatch.reset_stats()
            states = {variant: DecodeState(requests, variant) for variant in VARIANTS}
            check_equal(states["stock"], states["fastbatch"], steps=8)
            counters = fastbatch.stats()  # what the fastbatch variant's pieces took
            for name, counter in (("schedule_running", "requests"),
                                  ("allocate_slots", "noop_allocations"),
                                  ("update_from_output", "fast_outputs"),
                                  ("after_schedule", "requests"),
                                  ("cached_requests", "requests")):
                assert counters[name][counter] > 0, f"fastbatch's {name} took no request"
            gc.collect()
            gc.freeze()
            current[requests] = states
        return current[requests]

    yield get
    gc.unfreeze()


def check_equal(stock: DecodeState, fast: DecodeState, steps: int) -> None:
    for _ in range(steps):
        for what, left, right in zip(("scheduler_output", "engine_core_outputs"),
                                     stock.step(), fast.step(), strict=True):
            found = lockstep.first_difference(lockstep.snapshot(left),
                                              lockstep.snapshot(right), what)
            assert found is None, f"fastbatch differs from stock: {found}"
    for state in (lockstep.kv_state, lockstep.request_state):
        found = lockstep.first_difference(state(stock.scheduler), state(fast.scheduler))
        assert found is None, f"fastbatch differs from stock: {found}"


@pytest.mark.parametrize(("requests", "variant"),
                         [pytest.param(r, v, id=f"{r}-{v}") for r in CELLS for v in VARIANTS])
def test_scheduler_decode_step(benchmark, decode_states, requests, variant):
    states = decode_states(requests)
    state = states[variant]
    started = time.perf_counter()
    state.step()  # also warms up
    once = time.perf_counter() - started
    rounds = max(3, min(MAX_ROUNDS - state.steps, int(ROUND_BUDGET_S / max(once, 1e-6))))
    benchmark.extra_info.update(group="scheduler_step", requests=requests, variant=variant)
    benchmark.pedantic(state.step, iterations=1, rounds=rounds)
    # Both variants have run the same traffic: bring them to the same step and compare.
    stock, fast = states["stock"], states["fastbatch"]
    while stock.steps < fast.steps:
        stock.step()
    while fast.steps < stock.steps:
        fast.step()
    check_equal(stock, fast, steps=1)

