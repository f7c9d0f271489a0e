"""Microbenchmarks of ``InputBatch.update_async_spec_token_ids`` on a real InputBatch.

Variants: ``stock`` (vLLM 0.33.0's own method), ``fastbatch`` (the method the
plugin installs, compiled kernel), ``fallback`` (the same with the pure-Python
reference), ``floor`` (one dict lookup and an in-place copy per request, no
checks: benchmarks/floor.pyx).  One test per cell, in paired rounds
(benchmarks/paired.py): pytest-benchmark times ``fastbatch``, the others are
timed in the same round on the same state.  Every call starts from vLLM's own
fresh per-step state (``SpecState.reset``, not timed: the spec lists refilled
with placeholders, fresh draft rows), and every variant is checked to leave the
spec lists and the draft rows exactly as stock vLLM does, so
``--benchmark-disable`` (CI) still tests each variant.  Run ``tox -e bench``
for the timed grid.
"""

import time

import pytest
from paired import PairedRounds, rounds_for
from spec_states import SPEC_GRID, STOCK_METHOD, VARIANTS, SpecState

TIMED = "fastbatch"
ROUND_BUDGET_S = 0.4  # per variant and cell: enough rounds for a steady median


@pytest.mark.parametrize("cell", [pytest.param(cell, id=cell.label) for cell in SPEC_GRID])
def test_spec_update(benchmark, spec_floor_update, cell):
    state = SpecState(cell)
    STOCK_METHOD(state.batch, state.reset())
    expected = state.result()
    methods = {**VARIANTS, "floor": spec_floor_update}
    timed = methods.pop(TIMED)

    def check(variant):
        assert state.result() == expected, f"{variant} differs from stock vLLM on {cell.label}"

    def prepare():
        return state.batch, state.reset()

    started = time.perf_counter()
    timed(*prepare())  # also warms up
    check(TIMED)
    for method in methods.values():
        method(*prepare())
    seconds_per_round = time.perf_counter() - started
    paired = PairedRounds(prepare, methods, check)
    benchmark.extra_info.update(group="spec_tokens", requests=cell.requests,
                                drafts=cell.drafts, variant=TIMED)
    benchmark.pedantic(timed, setup=paired.setup, teardown=paired.teardown, iterations=1,
                       rounds=rounds_for(seconds_per_round,
                                         ROUND_BUDGET_S * (1 + len(methods)), least=5))
    if benchmark.stats is not None:  # None with --benchmark-disable
        benchmark.extra_info["paired"] = paired.summary(TIMED, benchmark.stats.stats.data)
