"""Microbenchmarks of the runner's input preparation: ``_compute_prev_positions``
(group ``prev_positions``) and ``_prepare_input_ids`` (group ``input_ids``).

Variants: ``stock`` (vLLM 0.33.0's own unbound method), ``fastbatch`` (the
method the plugin installs, compiled kernel), ``fallback`` (the same with the
pure-Python twin).  Each runs on a runner stand-in with vLLM's own
``CpuGpuBuffer``s on the CPU (``fastbatch.patches.prepare_input_ids.stand_in_call``).
Cells (requests, then the step's shape):

* ``decode``: the batch of the previous step, in place, one token each:
  vLLM's single-copy fast path after the loop;
* ``mixed``: after a condense(), 1 in 16 requests new (a 4-token prompt
  chunk) and the others moved: the loop, then the index tensors and scatters;
* ``spec3``: 3 draft tokens per request (a quarter with fewer), moved as in
  ``mixed``: the loop, then the sampled and the draft scatters.

The methods write the same buffers on every call, so rounds need no reset;
each benchmark checks that its variant left exactly stock's buffers, so
``--benchmark-disable`` (CI) still tests each variant.
"""

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.v1.utils import CpuGpuBuffer
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from fastbatch import _reference
from fastbatch.patches import prepare_input_ids as input_ids_patch
from fastbatch.patches import prev_positions as prev_positions_patch

REQUESTS = (1, 256, 1024)
SHAPES = ("decode", "mixed", "spec3")
ROUND_BUDGET_S = 0.3  # per benchmark: enough rounds for a steady median
STOCK_PREPARE = GPUModelRunner._prepare_input_ids
STOCK_PREV = GPUModelRunner._compute_prev_positions
assert not getattr(STOCK_PREPARE, "__fastbatch__", False), "benchmarks need stock vLLM"


def _with_twin(method, name):
    """``method`` with the fastbatch kernel it calls swapped for the twin."""
    twin = getattr(_reference, name)

    def fallback(*args):
        import fastbatch
        compiled = getattr(fastbatch, name)
        setattr(fastbatch, name, twin)
        try:
            return method(*args)
        finally:
            setattr(fastbatch, name, compiled)
    return fallback


PREPARE_VARIANTS = {
    "stock": STOCK_PREPARE,
    "fastbatch": input_ids_patch._prepare_input_ids,
    "fallback": _with_twin(input_ids_patch._prepare_input_ids, "prepare_input_ids_indices"),
}
PREV_VARIANTS = {
    "stock": STOCK_PREV,
    "fastbatch": prev_positions_patch._compute_prev_positions,
    "fallback": _with_twin(prev_positions_patch._compute_prev_positions,
                           "compute_prev_positions"),
}


def step_keywords(requests: int, shape: str, seed: int = 0) -> dict:
    """``stand_in_call`` keywords of one step of ``requests`` requests."""
    rng = np.random.default_rng(seed)
    req_ids = [f"req-{i}" for i in range(requests)]
    if shape == "decode":
        return dict(req_ids=req_ids, prev_positions=list(range(requests)),
                    num_scheduled=[1] * requests, scheduled_spec_tokens={},
                    num_prev_reqs=requests, prev_num_spec_tokens=0)
    k = 3 if shape == "spec3" else 0
    rows = rng.permutation(requests).tolist()
    new = rng.random(requests) < 1 / 16 if requests > 1 else np.zeros(1, bool)
    prev_positions = [-1 if is_new else row for row, is_new in zip(rows, new, strict=True)]
    drafts = [0 if is_new else (k if rng.random() >= 0.25 else int(rng.integers(0, k + 1)))
              for is_new in new] if k else [0] * requests
    spec = {req_id: [-1] * n for req_id, n in zip(req_ids, drafts, strict=True) if n}
    num_scheduled = [4 if is_new else 1 + n for is_new, n in zip(new, drafts, strict=True)]
    return dict(req_ids=req_ids, prev_positions=prev_positions, num_scheduled=num_scheduled,
                scheduled_spec_tokens=spec, num_prev_reqs=requests, prev_num_spec_tokens=k)


def _params(variants):
    for requests in REQUESTS:
        for shape in SHAPES:
            for variant in variants:
                yield pytest.param(requests, shape, variant,
                                   id=f"{shape}-{requests}-{variant}")


def _rounds(method, args):
    method(*args)  # warms up
    once = float("inf")
    for _ in range(3):  # the fastest of three: one slow call (GC, load) sets no limit
        started = time.perf_counter()
        method(*args)
        once = min(once, time.perf_counter() - started)
    return max(5, min(5000, int(ROUND_BUDGET_S / max(once, 1e-7))))


@pytest.mark.parametrize(("requests", "shape", "variant"), list(_params(PREPARE_VARIANTS)))
def test_prepare_input_ids(benchmark, requests, shape, variant):
    keywords = step_keywords(requests, shape)
    stock = input_ids_patch.stand_in_call(**keywords)
    STOCK_PREPARE(stock.runner, *stock.arguments)
    call = input_ids_patch.stand_in_call(**keywords)
    method = PREPARE_VARIANTS[variant]
    args = (call.runner, *call.arguments)
    rounds = _rounds(method, args)
    expected = input_ids_patch.call_state(stock)
    assert input_ids_patch.call_state(call) == expected, f"{variant} differs from stock"
    benchmark.extra_info.update(group="input_ids", requests=requests, shape=shape,
                                variant=variant)
    benchmark.pedantic(method, args=args, iterations=1, rounds=rounds)
    assert input_ids_patch.call_state(call) == expected, f"{variant} differs from stock"


def _prev_runner(keywords):
    requests = len(keywords["req_ids"])
    positions = CpuGpuBuffer(requests + 4, dtype=torch.int64, device=torch.device("cpu"),
                             pin_memory=False)
    prev_map = {req_id: row for req_id, row in zip(
        keywords["req_ids"], keywords["prev_positions"], strict=True) if row >= 0}
    # Finished requests stay in vLLM's map: one per new request.
    prev_map.update({f"finished-{i}": i for i in range(requests - len(prev_map))})
    return SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=list(keywords["req_ids"]),
                                    prev_req_id_to_index=prev_map),
        prev_positions=positions)


@pytest.mark.parametrize(("requests", "shape", "variant"),
                         [p for p in _params(PREV_VARIANTS) if "spec3" not in p.id])
def test_compute_prev_positions(benchmark, requests, shape, variant):
    keywords = step_keywords(requests, shape)
    stock, runner = _prev_runner(keywords), _prev_runner(keywords)
    STOCK_PREV(stock, requests)
    method = PREV_VARIANTS[variant]
    rounds = _rounds(method, (runner, requests))
    assert runner.prev_positions.np.tolist() == stock.prev_positions.np.tolist()
    benchmark.extra_info.update(group="prev_positions", requests=requests, shape=shape,
                                variant=variant)
    benchmark.pedantic(method, args=(runner, requests), iterations=1, rounds=rounds)
    assert runner.prev_positions.np.tolist() == stock.prev_positions.np.tolist()
