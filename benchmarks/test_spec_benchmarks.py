"""Microbenchmarks of ``InputBatch.update_async_spec_token_ids`` on a real InputBatch.

Variants: ``stock`` (vLLM 0.33.0's own method), ``fastbatch`` (the method the
plugin installs, compiled kernel), ``fallback`` (the same with the pure-Python
reference), ``floor`` (one dict lookup and an in-place copy per request, no
checks: benchmarks/floor.pyx).  Every round starts from vLLM's own fresh per-step state
(``SpecState.reset``, not timed: the spec lists refilled with placeholders,
fresh draft rows), and every benchmark checks that its variant left the spec
lists and the draft rows exactly as stock vLLM does, so ``--benchmark-disable``
(CI) still tests each variant.  Run ``tox -e bench`` for the timed grid.
"""

import time

import pytest
from spec_states import SPEC_GRID, STOCK_METHOD, VARIANTS, SpecState

ROUND_BUDGET_S = 0.4  # per benchmark: enough rounds for a steady median


def _params():
    """Cell-major order, so each state is built once for all its variants."""
    for cell in SPEC_GRID:
        for variant in (*VARIANTS, "floor"):
            yield pytest.param(cell, variant, id=f"{cell.label}-{variant}")


@pytest.fixture(scope="module")
def spec_state():
    """``spec_state(cell)``: the state of ``cell`` and stock vLLM's result on it,
    built once (one cell at a time)."""
    current = {}

    def get(cell):
        if cell not in current:
            current.clear()
            state = SpecState(cell)
            STOCK_METHOD(state.batch, state.reset())
            current[cell] = state, state.result()
        return current[cell]

    return get


@pytest.mark.parametrize(("cell", "variant"), list(_params()))
def test_spec_update(benchmark, spec_state, spec_floor_update, cell, variant):
    state, expected = spec_state(cell)
    method = {**VARIANTS, "floor": spec_floor_update}[variant]
    batch = state.batch

    draft_token_ids = state.reset()
    started = time.perf_counter()
    method(batch, draft_token_ids)  # also warms up
    once = time.perf_counter() - started
    assert state.result() == expected, f"{variant} differs from stock vLLM on {cell.label}"
    benchmark.extra_info.update(group="spec_tokens", requests=cell.requests,
                                drafts=cell.drafts, variant=variant)
    benchmark.pedantic(method, setup=lambda: ((batch, state.reset()), {}), iterations=1,
                       rounds=max(5, min(2000, int(ROUND_BUDGET_S / max(once, 1e-7)))))
    assert state.result() == expected, f"{variant} differs from stock vLLM on {cell.label}"
