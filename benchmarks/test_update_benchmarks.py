"""Microbenchmarks of the update over the grid, every variant on a real InputBatch.

Variants: ``stock`` (vLLM 0.33.0's own method), ``forward_scan`` (vLLM <= 0.21's
algorithm), ``fastbatch`` (the method the plugin installs, compiled kernel),
``fallback`` (the same with the pure-Python reference), ``floor`` (one dict
lookup and one list store per request; one-placeholder cells only).

Every round starts from the identical fresh state (``State.reset``, not
timed), and every benchmark checks that its variant left the batch exactly as
stock vLLM does, so ``--benchmark-disable`` (CI) still tests each variant.
Run ``tox -e bench`` for the timed grid and the report.
"""

import time

import pytest
from states import GRID, IDLE_CELLS, STOCK_METHOD, variants

VARIANTS = ("stock", "forward_scan", "fastbatch", "fallback", "floor")
ROUND_BUDGET_S = 0.4  # per benchmark: enough rounds for a steady median


def _params():
    """Cell-major order, so each state is built once for all its variants."""
    for cell in GRID + IDLE_CELLS:
        for variant in VARIANTS:
            if variant == "floor" and cell.mode != "decode":
                continue
            yield pytest.param(cell, variant, id=f"{cell.label}-{variant}")


_expected = {}


def _expected_tails(state):
    """The lists' tails after stock vLLM's update of this cell (computed once)."""
    if state.cell not in _expected:
        _expected.clear()
        state.reset()
        STOCK_METHOD(state.batch)
        _expected[state.cell] = state.tails()
    return _expected[state.cell]


@pytest.mark.parametrize(("cell", "variant"), list(_params()))
def test_update(benchmark, grid_state, floor_update, cell, variant):
    state = grid_state(cell)
    expected = _expected_tails(state)
    method = variants(floor_update)[variant]
    batch = state.batch

    state.reset()
    started = time.perf_counter()
    method(batch)  # also warms up
    once = time.perf_counter() - started
    benchmark.extra_info.update(requests=cell.requests, output_len=cell.output_len,
                                mode=cell.mode, variant=variant)
    state.reset()
    benchmark.pedantic(method, args=(batch,), setup=state.reset, iterations=1,
                       rounds=max(5, min(2000, int(ROUND_BUDGET_S / max(once, 1e-7)))))
    assert state.tails() == expected, f"{variant} differs from stock vLLM on {cell.label}"
