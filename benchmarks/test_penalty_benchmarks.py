"""Microbenchmarks of the penalties' output-token tensor (vLLM 0.33.0's
``penalties._convert_to_tensors`` + the -1 masking in ``apply_all_penalties``).

Variants: ``stock`` (vLLM's function, then ``masked_fill_(t == -1, vocab_size)``
as ``apply_all_penalties`` does), ``stock_convert`` (vLLM's function alone: on
a GPU the masking runs on the device, so this is stock's CPU cost there; it is
checked after masking its result, untimed), ``fastbatch`` (what the installed
``apply_all_penalties`` runs, with the piece applied: the compiled conversion,
masking folded in, and no masking after it; like for like with ``stock``),
``fallback`` (the pure-Python conversion, masking folded in; the same with the
pure-Python reference; not run above ``FALLBACK_MAX_TOKENS``, where one call
takes seconds).  No variant changes its input; every benchmark checks that its
tensor equals stock's (values, shape, dtype), so ``--benchmark-disable`` (CI)
still tests each variant.  Run ``tox -e bench`` for the timed grid.
"""

import time

import pytest
import torch
from penalty_states import (
    FALLBACK_MAX_TOKENS,
    PENALTY_GRID,
    PIECE_APPLIED,
    STOCK_CONVERT,
    UNMASKED,
    VARIANTS,
    VOCAB_SIZE,
    output_token_rows,
    patch,
    penalties,
    stock,
)

ROUND_BUDGET_S = 0.4  # per benchmark: enough rounds for a steady median


@pytest.fixture(autouse=True)
def no_pinned_memory(monkeypatch):
    """Stock pins its tensor when ``penalties.PIN_MEMORY`` is true, and pinning
    needs an accelerator: on a CPU-only machine it raises "Cannot access
    accelerator device".  vLLM 0.33.0 sets the flag from its platform at import
    (True where the platform is not resolved to the CPU one, e.g. the CUDA wheel
    without VLLM_TARGET_DEVICE=cpu), so it is forced off here.  fastbatch's
    drop-in reads the same flag at call time, so both build unpinned tensors."""
    monkeypatch.setattr(penalties, "PIN_MEMORY", False)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Stock's masking (``t == -1``, ``masked_fill_``) runs here on the CPU, where
    torch splits ops over 32K elements across its OpenMP pool; on this small,
    shared machine that wait cost up to ~20 ms a call (0.2 ms on one thread,
    at 1024 x 100).  One thread keeps stock's masking at its cheapest (on a GPU
    it would not be on the CPU at all); fastbatch uses no torch op but
    ``torch.empty``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _params():
    """Cell-major order, so each cell's rows are built once for all its variants."""
    for cell in PENALTY_GRID:
        for variant in VARIANTS:
            if variant == "fallback" and cell.requests * cell.output_len > FALLBACK_MAX_TOKENS:
                continue  # the pure-Python fallback: seconds per call there
            yield pytest.param(cell, variant, id=f"{cell.label}-{variant}")


@pytest.fixture(scope="module")
def penalty_state():
    """``penalty_state(cell)``: the rows of ``cell`` and stock's tensor for them,
    built once; the previous cell's are dropped (the largest hold ~1 GB)."""
    current = {}

    def get(cell):
        if cell not in current:
            current.clear()
            rows = output_token_rows(cell)
            assert any(row[-1] == -1 for row in rows), "no placeholder to mask"
            current[cell] = rows, stock(rows, VOCAB_SIZE, "cpu")
        return current[cell]

    return get


def _check(got, expected, variant, cell):
    if variant in UNMASKED:
        got = got.masked_fill(got == -1, VOCAB_SIZE)
    assert got.dtype == expected.dtype and got.shape == expected.shape, (
        f"{variant} gave {got.dtype} {tuple(got.shape)} on {cell.label}, "
        f"stock {expected.dtype} {tuple(expected.shape)}")
    assert torch.equal(got, expected), f"{variant} differs from stock vLLM on {cell.label}"


@pytest.fixture
def piece(request, no_pinned_memory):
    """The penalties piece applied for the variants that time the installed
    path, reverted after; stock vLLM for the others."""
    applied = request.node.callspec.params["variant"] in PIECE_APPLIED
    if applied:
        assert patch.apply(), "the penalties piece refused to install"
    yield
    if applied:
        patch.revert()
    assert penalties._convert_to_tensors is STOCK_CONVERT


@pytest.mark.parametrize(("cell", "variant"), list(_params()))
def test_penalty_tensor(benchmark, penalty_state, piece, cell, variant):
    rows, expected = penalty_state(cell)
    function = VARIANTS[variant]
    assert expected.shape == (cell.requests, cell.output_len)

    started = time.perf_counter()
    _check(function(rows, VOCAB_SIZE, "cpu"), expected, variant, cell)  # also warms up
    once = time.perf_counter() - started
    benchmark.extra_info.update(group="penalties", requests=cell.requests,
                                output_len=cell.output_len, variant=variant)
    got = benchmark.pedantic(function, args=(rows, VOCAB_SIZE, "cpu"), iterations=1,
                             rounds=max(5, min(2000, int(ROUND_BUDGET_S / max(once, 1e-7)))))
    _check(got, expected, variant, cell)
