"""Microbenchmarks of the step's rows-to-lists conversions, stock vLLM 0.33.0
against the methods ``FASTBATCH=1`` installs, in the same run.

* ``get_output``: ``AsyncGPUModelRunnerOutput.get_output`` on a plain decode
  step (one id per request, int32, one request in 64 discarded), on a real
  output object whose ``__init__`` was skipped (it records a CUDA event);
* ``parse_output``: ``RejectionSampler.parse_output`` on a spec step (width 4:
  k = 3 drafts + 1, rejected slots -1, int32);
* ``draft_token_ids``: ``GPUModelRunner._get_draft_token_ids_cpu`` (k = 4 drafts,
  int64 buffer of ``max_num_reqs`` rows);
* ``spec_step``: issue 10's whole spec step at 256 requests, k = 3: the
  drafts' conversion to lists and ``InputBatch.update_async_spec_token_ids``
  (stock: ``.tolist()`` and vLLM's loop; fastbatch: both pieces).

Each at 1, 256 and 1024 requests; every benchmark checks that its variant
gives exactly stock vLLM's lists (``--benchmark-disable``, CI, still tests
them).  Group ``row_lists`` in the JSON.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from spec_states import STOCK_METHOD as STOCK_SPEC_UPDATE
from spec_states import SpecCell, SpecState
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.sample.rejection_sampler import RejectionSampler
from vllm.v1.worker.gpu_model_runner import AsyncGPUModelRunnerOutput, GPUModelRunner

from fastbatch.patches import async_spec_token_ids as spec_patch
from fastbatch.patches import draft_token_ids, get_output, parse_output

ROUND_BUDGET_S = 0.3  # per benchmark: enough rounds for a steady median
REQUESTS = (1, 256, 1024)
SPEC_WIDTH = 4
VOCAB_SIZE = 151_936
STOCK = {
    "get_output": AsyncGPUModelRunnerOutput.get_output,
    "parse_output": RejectionSampler.parse_output,
    "draft_token_ids": GPUModelRunner._get_draft_token_ids_cpu,
}
assert not any(getattr(m, "__fastbatch__", False) for m in STOCK.values()), \
    "benchmarks need stock vLLM"
FASTBATCH = {
    "get_output": get_output.get_output,
    "parse_output": parse_output.parse_output,
    "draft_token_ids": draft_token_ids._get_draft_token_ids_cpu,
}


def _ids(rng, num_rows, width, dtype):
    return torch.from_numpy(rng.integers(0, VOCAB_SIZE, (num_rows, width))).to(dtype)


def get_output_args(n, rng):
    """A fresh decode-step output object per round (``get_output`` deletes
    some of its attributes)."""
    sampled = _ids(rng, n, 1, torch.int32)
    req_ids = [f"req-{i}" for i in range(n)]
    req_id_to_index = {r: i for i, r in enumerate(req_ids)}
    invalid = list(range(0, n, 64))[1:]

    def make():
        output = object.__new__(AsyncGPUModelRunnerOutput)
        output.__dict__.update(
            _model_runner_output=ModelRunnerOutput(req_ids=req_ids,
                                                   req_id_to_index=req_id_to_index),
            _invalid_req_indices=invalid, async_copy_ready_event=torch.Event(),
            _sampled_token_ids=sampled, sampled_token_ids_cpu=sampled,
            vocab_size=VOCAB_SIZE, _logprobs_tensors=None, _logprobs_tensors_cpu=None,
            _num_nans=None, _num_nans_cpu=None, _has_fault=None)
        return (output,), {}

    return make, lambda result: result.sampled_token_ids


def parse_output_args(n, rng):
    ids = _ids(rng, n, SPEC_WIDTH, torch.int32)
    accepted = rng.integers(1, SPEC_WIDTH + 1, n)
    for row in range(n):
        ids[row, accepted[row]:] = -1
    discard = list(range(0, n, 64))[1:]
    return lambda: ((ids, VOCAB_SIZE, discard), {}), lambda result: result


def draft_token_ids_args(n, rng):
    buffer = _ids(rng, n, SPEC_WIDTH, torch.int64)
    runner = object.__new__(GPUModelRunner)
    runner.__dict__.update(
        _draft_token_ids=torch.zeros((n, SPEC_WIDTH), dtype=torch.int64),
        _draft_token_req_ids=[f"req-{i}" for i in range(n)], draft_token_ids_cpu=buffer,
        draft_token_ids_event=torch.Event(), input_batch=SimpleNamespace(req_ids=[]))
    return lambda: ((runner,), {}), lambda result: result


ARGS = {"get_output": get_output_args, "parse_output": parse_output_args,
        "draft_token_ids": draft_token_ids_args}


def _measure(benchmark, function, setup, extract, expected, **info):
    args, kwargs = setup()
    started = time.perf_counter()
    result = extract(function(*args, **kwargs))  # also warms up
    once = time.perf_counter() - started
    assert result == expected, f"{info} differs from stock vLLM"
    assert all(type(row) is list and all(type(t) is int for t in row)
               for row in (result[0] if isinstance(result, tuple) else result))
    benchmark.extra_info.update(group="row_lists", **info)
    result = benchmark.pedantic(function, setup=setup, iterations=1,
                                rounds=max(5, min(2000, int(ROUND_BUDGET_S / max(once, 1e-7)))))
    assert extract(result) == expected, f"{info} differs from stock vLLM"


@pytest.mark.parametrize("variant", ["stock", "fastbatch"])
@pytest.mark.parametrize("requests", REQUESTS)
@pytest.mark.parametrize("piece", list(ARGS))
def test_row_lists(benchmark, piece, requests, variant):
    setup, extract = ARGS[piece](requests, np.random.default_rng(requests))
    args, kwargs = setup()
    expected = extract(STOCK[piece](*args, **kwargs))
    function = STOCK[piece] if variant == "stock" else FASTBATCH[piece]
    _measure(benchmark, function, setup, extract, expected, piece=piece,
             requests=requests, width=1 if piece == "get_output" else SPEC_WIDTH,
             variant=variant)


def _spec_step_runner(state):
    """A runner stand-in whose draft buffer is ``state``'s (k = 3)."""
    n, k = state.cell.requests, state.cell.drafts
    runner = object.__new__(GPUModelRunner)
    runner.__dict__.update(
        _draft_token_ids=torch.zeros((n, k), dtype=torch.int64),
        _draft_token_req_ids=list(state.batch.req_ids),
        draft_token_ids_cpu=state.draft_token_ids_cpu,
        draft_token_ids_event=torch.Event(), input_batch=state.batch)
    return runner


@pytest.mark.parametrize("variant", ["stock", "fastbatch"])
def test_spec_step(benchmark, variant):
    """Issue 10's spec step, 256 requests, k = 3: drafts to lists, then the
    spec-token update, on a real InputBatch (refilled before every round)."""
    state = SpecState(SpecCell(256, 3))
    runner = _spec_step_runner(state)
    to_lists, update = ((STOCK["draft_token_ids"], STOCK_SPEC_UPDATE) if variant == "stock" else
                        (FASTBATCH["draft_token_ids"], spec_patch.update_async_spec_token_ids))

    def step():
        draft_token_ids, _ = to_lists(runner)
        update(state.batch, draft_token_ids)
        return draft_token_ids

    state.reset()
    stock_drafts, _ = STOCK["draft_token_ids"](runner)
    STOCK_SPEC_UPDATE(state.batch, stock_drafts)
    expected = state.result()[0], stock_drafts

    def setup():
        state.reset()
        return (), {}

    setup()
    drafts = step()
    assert (state.result()[0], drafts) == expected, f"{variant} differs from stock vLLM"
    benchmark.extra_info.update(group="row_lists", piece="spec_step", requests=256,
                                width=3, variant=variant)
    started = time.perf_counter()
    setup()
    step()
    once = time.perf_counter() - started
    drafts = benchmark.pedantic(step, setup=setup, iterations=1,
                                rounds=max(5, min(2000, int(ROUND_BUDGET_S / max(once, 1e-7)))))
    assert (state.result()[0], drafts) == expected, f"{variant} differs from stock vLLM"
