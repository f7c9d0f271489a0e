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
variant.  Cold cells (``COLD_CELLS``): histories laid out as a generation
builds them, caches flushed before every call.  Run ``tox -e bench`` for the
timed grid and the report.
"""

import time

import pytest
from paired import Evictor, PairedRounds, rounds_for
from states import COLD_CELLS, GRID, IDLE_CELLS, STOCK_METHOD, variants

TIMED = "fastbatch"
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
    if cell.cold:  # stock, fastbatch and the floor (the others: ms per call, few rounds)
        del methods["forward_scan"], methods["fallback"]
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
    if cell.cold:
        started = time.perf_counter()
        evict()
        seconds_per_round += (time.perf_counter() - started) * (1 + len(methods))
    paired = PairedRounds(prepare, methods, check, evict if cell.cold else None)
    benchmark.extra_info.update(requests=cell.requests, output_len=cell.output_len,
                                mode=cell.mode, cold=cell.cold, variant=TIMED)
    benchmark.pedantic(timed, setup=paired.setup, teardown=paired.teardown, iterations=1,
                       rounds=rounds_for(seconds_per_round,
                                         ROUND_BUDGET_S * (1 + len(methods)), least=5))
    if benchmark.stats is not None:  # None with --benchmark-disable
        benchmark.extra_info["paired"] = paired.summary(TIMED, benchmark.stats.stats.data)
