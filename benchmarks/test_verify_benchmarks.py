"""What ``FASTBATCH_VERIFY`` costs per call, against stock in the same run.

Variants, per piece: ``stock`` (vLLM 0.33.0's own code), ``fastbatch`` (the
drop-in the plugin installs), ``verify`` (the same with every call checked:
``FASTBATCH_VERIFY=1``, i.e. fastbatch + vLLM's code on a copy + compare) and
``sampled`` (``FASTBATCH_VERIFY=0.01``).  The target: ``verify`` costs at most
about ``fastbatch`` + ``stock``; ``sampled`` is within noise of ``fastbatch``.
Each benchmark checks its variant's result against stock's and that no
divergence was found, so ``--benchmark-disable`` (CI) still tests each one.
"""

import time

import pytest
import torch
from penalty_states import STOCK_CONVERT, VOCAB_SIZE, PenaltyCell, output_token_rows, penalties
from penalty_states import stock as stock_penalties
from spec_states import STOCK_METHOD as STOCK_SPEC_METHOD
from spec_states import SpecCell, SpecState
from states import STOCK_METHOD, Cell, State

from fastbatch import _verify
from fastbatch.patches import async_output_token_ids as output_patch
from fastbatch.patches import async_spec_token_ids as spec_patch
from fastbatch.patches import penalty_output_tokens as penalty_patch

ROUND_BUDGET_S = 0.4  # per benchmark: enough rounds for a steady median
VARIANTS = ("stock", "fastbatch", "verify", "sampled")
SAMPLED_RATE = 0.01
CELLS = [("output", Cell(256, 4000, "decode")), ("output", Cell(256, 4000, "spec")),
         ("output", Cell(1024, 4000, "decode")), ("spec", SpecCell(256, 3)),
         ("spec", SpecCell(1024, 3)), ("penalties", PenaltyCell(256, 100)),
         ("penalties", PenaltyCell(256, 4000))]
PATCHES = {"output": output_patch, "spec": spec_patch, "penalties": penalty_patch}
STOCK = {"output": STOCK_METHOD, "spec": STOCK_SPEC_METHOD, "penalties": STOCK_CONVERT}


@pytest.fixture(autouse=True)
def stock_penalties_unpinned(monkeypatch):
    """No accelerator to pin with here (see test_penalty_benchmarks.py); one torch
    thread keeps stock's masking at its cheapest."""
    monkeypatch.setattr(penalties, "PIN_MEMORY", False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _variant(piece, variant):
    """The callable of ``variant`` for ``piece`` (vLLM stock is the original)."""
    patch, stock = PATCHES[piece].PATCH, STOCK[piece]
    if variant == "stock":
        return stock
    if variant == "fastbatch":
        return patch.replacement
    return _verify.checked_replacement(patch, stock, 1.0 if variant == "verify" else SAMPLED_RATE)


_states: dict = {}


def _state(piece, cell):
    """The state of ``cell`` for ``piece``, built once (one cell at a time)."""
    if (piece, cell) not in _states:
        _states.clear()
        if piece == "output":
            _states[piece, cell] = State(cell)
        elif piece == "spec":
            _states[piece, cell] = SpecState(cell)
        else:
            rows = output_token_rows(cell)
            _states[piece, cell] = rows, stock_penalties(rows, VOCAB_SIZE, "cpu")
    return _states[piece, cell]


def _params():
    for piece, cell in CELLS:
        for variant in VARIANTS:
            yield pytest.param(piece, cell, variant, id=f"{piece}-{cell.label}-{variant}")


@pytest.mark.parametrize(("piece", "cell", "variant"), list(_params()))
def test_verify_overhead(benchmark, piece, cell, variant):
    function = _variant(piece, variant)
    patch = PATCHES[piece].PATCH
    patch.divergences = 0
    state = _state(piece, cell)
    if piece == "output":
        stock = _variant("output", "stock")
        state.reset()
        stock(state.batch)
        expected = state.tails()

        def setup():
            state.reset()
            return (state.batch,), {}

        def result():
            return state.tails()
    elif piece == "spec":
        stock = _variant("spec", "stock")
        stock(state.batch, state.reset())
        expected = state.result()

        def setup():
            return (state.batch, state.reset()), {}

        result = state.result
    else:
        rows, expected_tensor = state
        expected = expected_tensor.tolist()
        outputs = []

        def setup():
            return (rows, VOCAB_SIZE, "cpu"), {}

        def result():
            got = outputs[-1]
            return got.masked_fill(got == -1, VOCAB_SIZE).tolist()

    args, kwargs = setup()
    started = time.perf_counter()
    got = function(*args, **kwargs)  # also warms up
    once = time.perf_counter() - started
    if piece == "penalties":
        outputs.append(got)
    assert result() == expected, f"{variant} differs from stock vLLM on {cell.label}"
    benchmark.extra_info.update(group="verify", piece=piece, cell=cell.label,
                                variant=variant)
    got = benchmark.pedantic(function, setup=setup, iterations=1,
                             rounds=max(5, min(2000, int(ROUND_BUDGET_S / max(once, 1e-7)))))
    if piece == "penalties":
        outputs.append(got)
    assert result() == expected, f"{variant} differs from stock vLLM on {cell.label}"
    assert patch.divergences == 0
