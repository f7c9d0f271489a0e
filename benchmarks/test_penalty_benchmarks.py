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
still tests each variant.  One test per cell, in paired rounds
(benchmarks/paired.py): pytest-benchmark times ``fastbatch``, the others are
timed in the same round, just before or after it.  Run ``tox -e bench`` for the timed grid.
"""

import time

import pytest
import torch
from paired import PairedRounds, rounds_for
from penalty_states import (
    FALLBACK_MAX_TOKENS,
    PENALTY_GRID,
    STOCK_CONVERT,
    UNMASKED,
    VARIANTS,
    VOCAB_SIZE,
    output_token_rows,
    penalties,
    stock,
)

from fastbatch import registry

TIMED = "fastbatch"
ROUND_BUDGET_S = 0.4  # per variant and cell: enough rounds for a steady median


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


@pytest.fixture
def piece(no_pinned_memory):
    """The penalties piece applied (the timed variant runs the installed path),
    reverted after; the other variants call vLLM's functions directly."""
    penalty_piece = registry.piece("penalty_output_tokens")
    assert penalty_piece.apply(), "the penalties piece refused to install"
    yield
    penalty_piece.revert()
    assert penalties._convert_to_tensors is STOCK_CONVERT


def _check(got, expected, variant, cell):
    if variant in UNMASKED:
        got = got.masked_fill(got == -1, VOCAB_SIZE)
    assert got.dtype == expected.dtype and got.shape == expected.shape, (
        f"{variant} gave {got.dtype} {tuple(got.shape)} on {cell.label}, "
        f"stock {expected.dtype} {tuple(expected.shape)}")
    assert torch.equal(got, expected), f"{variant} differs from stock vLLM on {cell.label}"


@pytest.mark.parametrize("cell", [pytest.param(cell, id=cell.label) for cell in PENALTY_GRID])
def test_penalty_tensor(benchmark, piece, cell):
    rows = output_token_rows(cell)
    assert any(row[-1] == -1 for row in rows), "no placeholder to mask"
    expected = stock(rows, VOCAB_SIZE, "cpu")
    assert expected.shape == (cell.requests, cell.output_len)
    names = [name for name in VARIANTS if name != TIMED and not (
        name == "fallback" and cell.requests * cell.output_len > FALLBACK_MAX_TOKENS)]
    results = {}

    def keeping(name):
        def call(*args):
            results[name] = VARIANTS[name](*args)
        return call

    methods = {name: keeping(name) for name in names}
    timed = VARIANTS[TIMED]

    def check(variant):
        _check(results.pop(variant), expected, variant, cell)

    def prepare():
        return rows, VOCAB_SIZE, "cpu"

    started = time.perf_counter()
    _check(timed(*prepare()), expected, TIMED, cell)  # also warms up
    for method in methods.values():
        method(*prepare())
    results.clear()
    seconds_per_round = time.perf_counter() - started
    paired = PairedRounds(prepare, methods, check)
    benchmark.extra_info.update(group="penalties", requests=cell.requests,
                                output_len=cell.output_len, variant=TIMED)
    benchmark.pedantic(timed, setup=paired.setup, teardown=paired.teardown, iterations=1,
                       rounds=rounds_for(seconds_per_round,
                                         ROUND_BUDGET_S * (1 + len(methods)), least=5))
    results.clear()  # the largest hold ~1 GB
    if benchmark.stats is not None:  # None with --benchmark-disable
        benchmark.extra_info["paired"] = paired.summary(TIMED, benchmark.stats.stats.data)
