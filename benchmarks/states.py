"""Benchmark states: real vLLM 0.33.0 InputBatches, and the variants that update them.

A ``Cell`` is one point of the grid (requests, output length, decode or spec
decode, or nothing needed).  ``State`` holds a real ``InputBatch`` in that
shape and puts it back to the identical fresh state before every round
(``reset``): every variant mutates its input.
"""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM is imported

import numpy as np
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

from batches import vllm_0_21_method
from fastbatch import _reference
from fastbatch.patches import async_output_token_ids as patch
from fastbatch.patches._compare import NoWait

DRAFTS = 4  # spec decode: 1 bonus + 4 draft placeholders per step
REQUESTS = (1, 64, 256, 1024, 4096)
OUTPUT_LENGTHS = (100, 4000, 60000)
STOCK_METHOD = InputBatch.update_async_output_token_ids
assert not getattr(STOCK_METHOD, "__fastbatch__", False), "benchmarks need stock vLLM"


@dataclasses.dataclass(frozen=True)
class Cell:
    requests: int
    output_len: int
    mode: str  # "decode", "spec" (4 drafts, random acceptance) or "idle" (no async ids)
    # Cold: the histories laid out as a generation builds them (see
    # ``generate_histories``) and the caches flushed before every timed call.
    cold: bool = False

    @property
    def placeholders(self) -> int:
        return 1 + DRAFTS if self.mode == "spec" else 1

    @property
    def label(self) -> str:
        return f"{self.mode}{'-cold' if self.cold else ''}-{self.requests}x{self.output_len}"

    @property
    def warm(self) -> Cell:
        """The same cell with warm caches and one shared history."""
        return dataclasses.replace(self, cold=False)


GRID = [Cell(n, length, mode) for mode in ("decode", "spec")
        for n in REQUESTS for length in OUTPUT_LENGTHS]
# The engine's case: between two steps the forward pass evicts the lists and
# ints.  The warm twin of each is in GRID.
COLD_CELLS = [Cell(n, 4000, mode, cold=True) for mode in ("decode", "spec")
              for n in (256, 1024)]
IDLE_CELLS = [Cell(256, 4000, "idle"), Cell(4096, 4000, "idle")]


def generate_histories(lists: list[list[int]], length: int, rng: np.random.Generator) -> None:
    """Appends ``length`` tokens to every list as a generation does: one step
    at a time, each step's ids fresh ints (``.tolist()`` of the sampled ids)
    appended request by request.  So the int objects of one request lie
    between those of the others, and the lists' buffers grow (and move)
    interleaved with them: each list's tail on another page than its header
    and than its neighbours'."""
    for _ in range(length):
        step = rng.integers(0, 32_000, len(lists)).tolist()
        for token_ids, token in zip(lists, step, strict=True):
            token_ids.append(token)


class State:
    """A real InputBatch holding ``cell``'s requests, ready for one update."""

    def __init__(self, cell: Cell, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.cell = cell
        batch = InputBatch(
            max_num_reqs=cell.requests, max_model_len=64, max_num_batched_tokens=64,
            device=torch.device("cpu"), vocab_size=32_000, block_sizes=[16],
            max_num_blocks_per_req=[4], logitsprocs_need_output_token_ids=True)
        for i in range(cell.requests):
            batch.add_request(CachedRequestState(
                req_id=f"req-{i}", prompt_token_ids=[1, 2, 3], mm_features=[],
                sampling_params=SamplingParams(temperature=0.0, repetition_penalty=1.1),
                generator=None, block_ids=([],), num_computed_tokens=3,
                output_token_ids=[]))
        batch.refresh_metadata()
        # Long histories are added after add_request (which copies outputs into
        # a [max_num_reqs, max_model_len] tensor): the lists are vLLM's own.
        if cell.cold:
            generate_histories(batch.req_output_token_ids, cell.output_len, rng)
        else:  # one shared history: compact, and cheap to build for the big cells
            history = [int(t) for t in rng.integers(0, 32_000, cell.output_len)]
            for token_ids in batch.req_output_token_ids:
                token_ids.extend(history)
        rows = rng.permutation(cell.requests)
        # The batch's own id strings as keys, as in vLLM (the map is built from
        # the previous step's req_ids), so lookups hit on identity.
        batch.prev_req_id_to_index = {req_id: int(row)
                                      for req_id, row in zip(batch.req_ids, rows, strict=True)}
        width = cell.placeholders
        sampled = rng.integers(0, 32_000, (cell.requests, width)).astype(np.int32)
        if cell.mode == "spec":  # accept 0..4 drafts (+ bonus), pad the rest with -1
            accepted = rng.integers(1, width + 1, cell.requests)
            sampled[np.arange(width)[None, :] >= accepted[:, None]] = -1
        batch.sampled_token_ids_cpu = None if cell.mode == "idle" else torch.from_numpy(sampled)
        batch.async_copy_ready_event = NoWait()
        self.batch = batch
        self.placeholder_tail = [-1] * width
        self.reset()

    def reset(self) -> None:
        """Back to the fresh state: each list is its history plus placeholders."""
        base = self.cell.output_len
        for token_ids in self.batch.req_output_token_ids:
            del token_ids[base:]
            token_ids.extend(self.placeholder_tail)

    def touch(self) -> None:
        """Read what an update reads (each id's map entry, each list's last
        items and the int before its placeholders), to make the state warm."""
        lookup = self.batch.prev_req_id_to_index.get
        before = -1 - self.cell.placeholders
        for req_id, token_ids in zip(self.batch.req_ids, self.batch.req_output_token_ids,
                                     strict=True):
            lookup(req_id)
            if token_ids[before] == -1:
                raise AssertionError("a placeholder inside the history")

    def tails(self) -> list[list[int]]:
        """What an update can change: every list from the end of its history on.

        (Each variant writes only there; histories hold no -1, so even the
        forward scan cannot write earlier.)
        """
        base = self.cell.output_len
        return [token_ids[base - 1:] for token_ids in self.batch.req_output_token_ids]


def fallback_method(self) -> None:
    """fastbatch's method with the pure-Python fallback in place of the kernel."""
    output_token_ids = self.sampling_metadata.output_token_ids
    if self.sampled_token_ids_cpu is None or not output_token_ids:
        return
    _reference.update_async_output_token_ids(
        self.req_ids, self.prev_req_id_to_index, output_token_ids,
        self.sampled_token_ids_cpu, self.async_copy_ready_event)


def floor_method(floor_update):
    """The floor kernel behind the same early return as the others."""
    def method(self) -> None:
        output_token_ids = self.sampling_metadata.output_token_ids
        if self.sampled_token_ids_cpu is None or not output_token_ids:
            return
        self.async_copy_ready_event.synchronize()
        floor_update(self.req_ids, self.prev_req_id_to_index, output_token_ids,
                     self.sampled_token_ids_cpu)
    return method


def variants(floor_update) -> dict[str, object]:
    """Each variant as an unbound method of InputBatch."""
    return {
        "stock": STOCK_METHOD,
        "forward_scan": vllm_0_21_method,
        "fastbatch": patch.update_async_output_token_ids,
        "fallback": fallback_method,
        "floor": floor_method(floor_update),
    }
