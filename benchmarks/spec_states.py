"""Benchmark states for the spec-token update: a real vLLM 0.33.0 InputBatch in
the shape ``InputBatch.update_async_spec_token_ids`` sees it every spec-decode
step under async scheduling, and the variants that update it.

A ``SpecCell`` is (requests, k draft tokens per request).  Each round starts
from vLLM's own per-step state (``SpecState.reset``, not timed):

* each request's spec list refilled with its scheduled placeholders by vLLM's
  own ``InputBatch.update_req_spec_token_ids`` (clear + extend); a quarter of
  the requests have fewer scheduled spec tokens than k (0 to k - 1: the
  scheduler trims drafts near ``max_tokens`` or for structured output);
* ``draft_token_ids`` fresh nested lists, as the model runner's
  ``_get_draft_token_ids_cpu`` makes them: ``.tolist()`` of an int64
  ``[num_reqs, k]`` CPU tensor (the ``.tolist()`` is the caller's, not timed);
* ``prev_req_id_to_index`` the previous step's row of each request, permuted;
  1 in 16 requests is new this step (not in it), and their rows belonged to
  requests that finished since (still in it, as in vLLM).
"""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM is imported

import numpy as np
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

from fastbatch import _reference
from fastbatch.patches import async_spec_token_ids as patch

REQUESTS = (1, 256, 1024)
DRAFTS = (1, 3, 5)
VOCAB_SIZE = 151_936
STOCK_METHOD = InputBatch.update_async_spec_token_ids
assert not getattr(STOCK_METHOD, "__fastbatch__", False), "benchmarks need stock vLLM"


@dataclasses.dataclass(frozen=True)
class SpecCell:
    requests: int
    drafts: int  # k: draft tokens proposed per request and step

    @property
    def label(self) -> str:
        return f"spec-tokens-{self.requests}xk{self.drafts}"


SPEC_GRID = [SpecCell(n, k) for n in REQUESTS for k in DRAFTS]


class SpecState:
    """A real InputBatch holding ``cell``'s requests, ready for one spec update."""

    def __init__(self, cell: SpecCell, seed: int = 0):
        rng = np.random.default_rng(seed)
        n, k = cell.requests, cell.drafts
        self.cell = cell
        batch = InputBatch(
            max_num_reqs=n, max_model_len=64, max_num_batched_tokens=64,
            device=torch.device("cpu"), vocab_size=VOCAB_SIZE, block_sizes=[16],
            max_num_blocks_per_req=[4], logitsprocs_need_output_token_ids=True)
        self.requests = [CachedRequestState(
            req_id=f"req-{i}", prompt_token_ids=[1, 2, 3], mm_features=[],
            sampling_params=SamplingParams(temperature=0.0, repetition_penalty=1.1),
            generator=None, block_ids=([],), num_computed_tokens=3,
            output_token_ids=[]) for i in range(n)]
        for request in self.requests:
            batch.add_request(request)
        batch.refresh_metadata()
        assert batch.sampling_metadata.spec_token_ids is batch.spec_token_ids

        # Scheduled spec tokens (async scheduling: -1 placeholders).
        scheduled = np.full(n, k)
        trimmed = rng.random(n) < 0.25 if n > 1 else np.zeros(n, dtype=bool)
        scheduled[trimmed] = rng.integers(0, k, int(trimmed.sum()))
        self.scheduled = {f"req-{i}": [-1] * int(m) for i, m in enumerate(scheduled) if m}

        # Previous step: the same requests in another order, less the new ones,
        # whose rows were held by requests that have finished since.
        # The keys are the batch's own id strings, as in vLLM (the map is built
        # from the previous step's req_ids), so lookups hit on identity.
        rows = rng.permutation(n)
        new = rng.random(n) < 1 / 16 if n > 1 else np.zeros(n, dtype=bool)
        req_ids = batch.req_ids
        batch.prev_req_id_to_index = {
            (f"finished-{i}" if new[i] else req_ids[i]): int(rows[i]) for i in range(n)}
        self.draft_token_ids_cpu = torch.from_numpy(
            rng.integers(0, VOCAB_SIZE, (n, k), dtype=np.int64))
        self.batch = batch
        self.draft_token_ids: list[list[int]] = []
        self.reset()

    def reset(self) -> list[list[int]]:
        """Back to the fresh state; returns this step's fresh draft rows."""
        for request in self.requests:
            self.batch.update_req_spec_token_ids(request, self.scheduled)
        self.draft_token_ids = self.draft_token_ids_cpu.tolist()
        return self.draft_token_ids

    def result(self) -> tuple[list[list[int]], list[list[int]]]:
        """What an update changes: the spec lists and (truncated) the draft rows."""
        return ([list(ids) for ids in self.batch.spec_token_ids],
                [list(ids) for ids in self.draft_token_ids])


def fallback_method(self, draft_token_ids: list[list[int]]) -> None:
    """fastbatch's method with the pure-Python fallback in place of the kernel."""
    if not draft_token_ids or not self.prev_req_id_to_index:
        return
    if (spec_token_ids := self.sampling_metadata.spec_token_ids) is not None:
        _reference.update_async_spec_token_ids(
            self.req_ids, self.prev_req_id_to_index, spec_token_ids, draft_token_ids)


VARIANTS = {
    "stock": STOCK_METHOD,
    "fastbatch": patch.update_async_spec_token_ids,
    "fallback": fallback_method,
}
