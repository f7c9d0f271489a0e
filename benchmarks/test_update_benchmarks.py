"""Microbenchmarks of the update over the grid, every variant on a real InputBatch.

Variants: ``stock`` (vLLM 0.33.0's own method), ``forward_scan`` (vLLM <= 0.21's
algorithm), ``fastbatch`` (the method the plugin installs, compiled kernel),
``fallback`` (the same with the pure-Python reference), ``floor`` (one dict
lookup and one list store per request; one-placeholder cells only).

One test per cell, in paired rounds (benchmarks/paired.py): pytest-benchmark
times ``fastbatch``, and every other variant is timed in the same round on the
same state, just before or after it.  Every call starts from the identical
fresh state (``State.reset``, not timed), and every variant's result is
checked against stock vLLM's, so ``--benchmark-disable`` (CI) still tests each
variant.  Warm cells: the state read right before every call (``State.touch``).
Cold cells (``COLD_CELLS``): histories laid out as a generation
builds them, caches flushed before every call.  Run ``tox -e bench`` for the
timed grid and the report.
"""

import time

import pytest
from paired import Evictor, PairedRounds, rounds_for
from states import COLD_CELLS, GRID, IDLE_CELLS, STOCK_METHOD, variants

TIMED = "fastbatch"
SLOW = ("forward_scan", "fallback")  # timed in rounds of their own
ROUND_BUDGET_S = 0.4  # per variant and cell: enough rounds for a steady median


def _params():
    """Cell-major order, so each state is built once."""
    for cell in GRID + COLD_CELLS + IDLE_CELLS:
        yield pytest.param(cell, id=cell.label)


@pytest.fixture(scope="module")
def evict():
    return Evictor()


@pytest.mark.parametrize("cell", list(_params()))
def test_update(benchmark, grid_state, floor_update, evict, cell):
    state = grid_state(cell)
    batch = state.batch
    state.reset()
    STOCK_METHOD(batch)
    expected = state.tails()
    methods = variants(floor_update)
    if cell.mode != "decode":
        del methods["floor"]  # the floor handles one placeholder per list
    # Slow variants: rounds of their own (see benchmarks/paired.py); none when cold.
    slow = {} if cell.cold else {name: methods[name] for name in SLOW}
    for name in SLOW:
        del methods[name]
    timed = methods.pop(TIMED)

    def check(variant):
        assert state.tails() == expected, f"{variant} differs from stock vLLM on {cell.label}"

    def prepare():
        state.reset()
        return (batch,)

    started = time.perf_counter()
    timed(*prepare())  # also warms up
    check(TIMED)
    for method in methods.values():
        method(*prepare())
    seconds_per_round = time.perf_counter() - started
    slow_seconds = 0.0
    for method in slow.values():
        started = time.perf_counter()
        method(*prepare())
        slow_seconds += time.perf_counter() - started
    if cell.cold:
        started = time.perf_counter()
        evict()
        seconds_per_round += (time.perf_counter() - started) * (1 + len(methods))
    paired = PairedRounds(prepare, methods, check, evict if cell.cold else None, state.touch)
    benchmark.extra_info.update(requests=cell.requests, output_len=cell.output_len,
                                mode=cell.mode, cold=cell.cold, variant=TIMED)
    benchmark.pedantic(timed, setup=paired.setup, teardown=paired.teardown, iterations=1,
                       rounds=rounds_for(seconds_per_round,
                                         ROUND_BUDGET_S * (1 + len(methods)), least=5))
    slow_paired = PairedRounds(prepare, slow, check, None, state.touch)
    slow_times = slow_paired.run(timed, 1 if benchmark.stats is None else rounds_for(
        slow_seconds, ROUND_BUDGET_S * len(slow), most=200, least=5))
    if benchmark.stats is not None:  # None with --benchmark-disable
        summary = paired.summary(TIMED, benchmark.stats.stats.data)
        slow_summary = slow_paired.summary(TIMED, slow_times)
        for key in ("median_seconds", "ratios"):
            summary[key].update({name: slow_summary[key][name] for name in slow})
        benchmark.extra_info["paired"] = summary
