"""Microbenchmarks of ``GPUModelRunner._bookkeeping_sync`` on a real InputBatch.

One plain decode step (one sampled token per request) at 1, 256 and 1024
requests, with async scheduling (one ``-1`` placeholder per request) and
without (the sampled ids).  Variants: ``stock`` (vLLM 0.33.0's own method),
``fastbatch`` (the method the plugin installs, compiled kernel),
``fallback`` (the same with the pure-Python twin).  The runner is a stand-in
carrying a real ``InputBatch`` and real ``CachedRequestState`` objects.  Every
round starts from the same state (``BookkeepingState.reset``, not timed), and
every benchmark checks that its variant left the arrays, the output lists and
the return value exactly as stock vLLM does, so ``--benchmark-disable`` (CI)
still tests each variant.  Run ``tox -e bench`` for the timed grid.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import MethodType, SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

import fastbatch
from fastbatch import _reference
from fastbatch.patches import bookkeeping_sync as patch

ROUND_BUDGET_S = 0.4  # per benchmark: enough rounds for a steady median
MAX_MODEL_LEN = 512
PROMPT_LEN, OUTPUT_LEN = 64, 100
STOCK_METHOD = patch.PATCH.original() or GPUModelRunner._bookkeeping_sync


@dataclass(frozen=True)
class Cell:
    requests: int
    use_async: bool

    @property
    def label(self) -> str:
        return f"{self.requests}-{'async' if self.use_async else 'sync'}"


GRID = [Cell(n, use_async) for n in (1, 256, 1024) for use_async in (True, False)]


def _fallback(self, *args):
    """The patched method with the pure-Python twin in place of the kernel."""
    compiled = fastbatch.append_sampled_token_ids
    fastbatch.append_sampled_token_ids = _reference.append_sampled_token_ids
    try:
        return patch._bookkeeping_sync(self, *args)
    finally:
        fastbatch.append_sampled_token_ids = compiled


VARIANTS = {"stock": STOCK_METHOD, "fastbatch": patch._bookkeeping_sync,
            "fallback": _fallback}


class BookkeepingState:
    """A runner stand-in after a decode step of ``cell.requests`` requests,
    each ``OUTPUT_LEN`` tokens into its output."""

    def __init__(self, cell: Cell) -> None:
        n = cell.requests
        batch = InputBatch(max_num_reqs=n, max_model_len=MAX_MODEL_LEN,
                           max_num_batched_tokens=max(n, 16), device=torch.device("cpu"),
                           vocab_size=32000, block_sizes=[16],
                           max_num_blocks_per_req=[MAX_MODEL_LEN // 16])
        requests = {}
        for index in range(n):
            state = CachedRequestState(
                req_id=f"req-{index}", prompt_token_ids=list(range(PROMPT_LEN)),
                mm_features=[], sampling_params=SamplingParams(temperature=0.0),
                generator=None, block_ids=([],), num_computed_tokens=PROMPT_LEN,
                output_token_ids=[(index * 7 + j) % 32000 for j in range(OUTPUT_LEN)])
            requests[state.req_id] = state
            batch.add_request(state)
        batch.refresh_metadata()
        self.runner = SimpleNamespace(
            use_async_scheduling=cell.use_async, max_model_len=MAX_MODEL_LEN,
            input_batch=batch, requests=requests, num_prompt_logprobs={},
            discard_request_mask=SimpleNamespace(np=np.zeros(n, dtype=bool)))
        self.runner._to_list = MethodType(CPUModelRunner._to_list, self.runner)
        self.runner._get_prompt_logprobs_dict = MethodType(
            GPUModelRunner._get_prompt_logprobs_dict, self.runner)
        self.sampled = torch.arange(n, dtype=torch.int32).reshape(n, 1) + 1000
        self.lists = [state.output_token_ids for state in requests.values()]
        self.num_tokens = batch.num_tokens_no_spec.copy()
        self.token_ids = batch.token_ids_cpu.copy()
        self.is_token = batch.is_token_ids.copy()

    def reset(self) -> tuple:
        """The state before the step, and the method's arguments."""
        batch = self.runner.input_batch
        for ids in self.lists:
            del ids[OUTPUT_LEN:]
        batch.num_tokens_no_spec[:] = self.num_tokens
        batch.token_ids_cpu[:] = self.token_ids
        batch.is_token_ids[:] = self.is_token
        batch.prev_sampled_token_ids = None
        sampler_output = SimpleNamespace(sampled_token_ids=self.sampled,
                                         logprobs_tensors=None)
        return (self.runner, SimpleNamespace(num_scheduled_tokens={}), sampler_output,
                None, torch.zeros(1), len(self.lists))

    def result(self, returned) -> list:
        batch = self.runner.input_batch
        return [returned, [list(ids) for ids in self.lists],
                batch.num_tokens_no_spec.tolist(), batch.token_ids_cpu.tolist(),
                batch.is_token_ids.tolist(), batch.prev_req_id_to_index,
                all(a is b for a, b in zip(batch.req_output_token_ids, self.lists,
                                           strict=True))]


@pytest.fixture(scope="module")
def bookkeeping_state():
    """``bookkeeping_state(cell)``: the state of ``cell`` and stock vLLM's result."""
    current = {}

    def get(cell):
        if cell not in current:
            current.clear()
            state = BookkeepingState(cell)
            current[cell] = state, state.result(STOCK_METHOD(*state.reset()))
        return current[cell]

    return get


@pytest.mark.parametrize(("cell", "variant"),
                         [pytest.param(cell, variant, id=f"{cell.label}-{variant}")
                          for cell in GRID for variant in VARIANTS])
def test_bookkeeping_sync(benchmark, bookkeeping_state, cell, variant):
    state, expected = bookkeeping_state(cell)
    method = VARIANTS[variant]
    started = time.perf_counter()
    returned = method(*state.reset())  # also warms up
    once = time.perf_counter() - started
    assert state.result(returned) == expected, f"{variant} differs from stock on {cell.label}"
    benchmark.extra_info.update(group="bookkeeping", requests=cell.requests,
                                use_async=cell.use_async, variant=variant)
    returned = benchmark.pedantic(method, setup=lambda: (state.reset(), {}), iterations=1,
                                  rounds=max(5, min(2000, int(ROUND_BUDGET_S / max(once, 1e-7)))))
    assert state.result(returned) == expected, f"{variant} differs from stock on {cell.label}"
