"""Batch states for the tests: hypothesis strategies, clones and oracles.

A ``Batch`` holds exactly what vLLM's ``InputBatch.update_async_output_token_ids``
reads: request ids (``None`` for holes left by ``remove_request``), the map
from request id to row of the previous step's sampled ids, the per-request
output lists, and the 2-D sampled ids.  ``real_input_batch`` builds one as a
real vLLM ``InputBatch`` (for the ``vllm``-marked tests; it imports vLLM when
called, so that this module imports neither vLLM nor torch).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import os
from typing import Any

import numpy as np
from hypothesis import strategies as st

# Batches may hold torch tensors where torch is installed (imported on use).
TORCH = importlib.util.find_spec("torch") is not None

# -1 drawn often, so that trailing runs, padded rows and -1 in the middle of a
# list all show up; 2**31 - 1 is the largest id int32 rows can hold.
TOKEN_IDS = st.sampled_from([-1, -1, -1, 0, 1, 2, 7, 50_000, 2**31 - 1])
# Output lists may also hold ints the kernel's inline fast paths do not cover:
# negative, multi-digit, bool, and an int subclass (equal to -1 or not).


class Token(int):
    """An int subclass: exercises the kernel's general (non-exact int) path."""


SMALL_ODD_ITEMS = [-2, True, False, Token(-1), Token(5)]
OUTPUT_ITEMS = st.one_of(TOKEN_IDS, TOKEN_IDS,
                         st.sampled_from([*SMALL_ODD_ITEMS, 2**70, -(2**70)]))
# A real InputBatch copies outputs into an int32 tensor: no multi-digit ints.
INT32_OUTPUT_ITEMS = st.one_of(TOKEN_IDS, TOKEN_IDS, st.sampled_from(SMALL_ODD_ITEMS))
DTYPES = ("int64", "int32")
LAYOUTS = ("C", "F", "strided", "reversed")


class CountingEvent:
    """Stands in for the CUDA copy-ready event: counts ``synchronize()`` calls."""

    def __init__(self) -> None:
        self.count = 0

    def synchronize(self) -> None:
        self.count += 1


@dataclasses.dataclass
class Batch:
    req_ids: list[str | None]
    prev_req_id_to_index: dict[str, int]
    output_token_ids: list[list[int] | None]
    sampled: np.ndarray  # logical values; see ``sampled_as``
    layout: str = "C"
    use_torch: bool = False

    def clone(self) -> Batch:
        return copy.deepcopy(self)

    def sampled_as_given(self) -> Any:
        """The sampled ids in this batch's memory layout and container."""
        return sampled_as(self.sampled, self.layout, self.use_torch)

    def needs_ids(self) -> bool:
        """True if vLLM would synchronise: some mapped list ends in -1."""
        return any(
            req_id in self.prev_req_id_to_index and ids and ids[-1] == -1
            for req_id, ids in zip(self.req_ids, self.output_token_ids, strict=True)
        )


def sampled_as(values: np.ndarray, layout: str, use_torch: bool = False) -> Any:
    """``values`` with the same logical content in another memory layout."""
    if layout == "C":
        array = np.ascontiguousarray(values)
    elif layout == "F":
        array = np.asfortranarray(values)
    elif layout == "strided":  # every other column of a wider array
        wide = np.full((values.shape[0], 2 * values.shape[1]), 99, values.dtype)
        wide[:, ::2] = values
        array = wide[:, ::2]
    elif layout == "reversed":  # negative strides on both axes
        array = np.ascontiguousarray(values[::-1, ::-1])[::-1, ::-1]
    else:
        raise ValueError(layout)
    assert np.array_equal(array, values)
    if use_torch:
        import torch

        if layout == "reversed":  # torch has no negative strides
            array = np.asfortranarray(values)
        tensor = torch.from_numpy(array)  # keeps the strides
        assert tensor.tolist() == values.tolist()
        return tensor
    return array


@st.composite
def sampled_rows(draw, width: int) -> list[int]:
    """One row: arbitrary ids, or accepted ids padded with -1 (spec decode)."""
    if draw(st.booleans()):
        return draw(st.lists(TOKEN_IDS, min_size=width, max_size=width))
    accepted = draw(st.integers(0, width))
    ids = draw(st.lists(TOKEN_IDS.filter(lambda t: t != -1),
                        min_size=accepted, max_size=accepted))
    return ids + [-1] * (width - accepted)


@st.composite
def batches(draw, max_reqs: int = 10, max_width: int = 6, max_prefix: int = 8,
            torch_allowed: bool = True, output_items=OUTPUT_ITEMS) -> Batch:
    """A valid batch covering every case vLLM's method handles."""
    num_reqs = draw(st.integers(0, max_reqs))
    req_ids: list[str | None] = []
    output_token_ids: list[list[int] | None] = []
    for i in range(num_reqs):
        if draw(st.integers(0, 7)) == 0:  # hole left by remove_request()
            req_ids.append(None)
            output_token_ids.append(None)
            continue
        req_ids.append(f"req-{i}")
        prefix = draw(st.lists(output_items, max_size=max_prefix))
        placeholder = draw(st.sampled_from([-1, -1, -1, Token(-1)]))
        output_token_ids.append(prefix + [placeholder] * draw(st.integers(0, 6)))

    live = [r for r in req_ids if r is not None]
    mapped = draw(st.lists(st.sampled_from(live), unique=True)) if live else []
    num_rows = draw(st.integers(len(mapped), len(mapped) + 3))
    if draw(st.integers(0, 9)) == 0 and num_rows:  # rows shared by requests
        rows = draw(st.lists(st.integers(0, num_rows - 1),
                             min_size=len(mapped), max_size=len(mapped)))
    else:
        rows = list(draw(st.permutations(range(num_rows))))[:len(mapped)]
    # Rows as vLLM stores them (int), or as other index-like objects.
    as_index = st.sampled_from([int, int, int, np.int64, Token])
    prev_req_id_to_index: dict[str, int] = {
        req_id: draw(as_index)(row) for req_id, row in zip(mapped, rows, strict=True)}
    for k in range(draw(st.integers(0, 2))):  # finished requests still mapped
        prev_req_id_to_index[f"finished-{k}"] = draw(st.integers(0, 50))

    width = draw(st.integers(0, max_width))
    dtype = draw(st.sampled_from(DTYPES))
    values = [draw(sampled_rows(width)) for _ in range(num_rows)]
    sampled = np.array(values, dtype=dtype).reshape(num_rows, width)
    layout = draw(st.sampled_from(LAYOUTS))
    use_torch = torch_allowed and TORCH and draw(st.booleans())
    return Batch(req_ids, prev_req_id_to_index, output_token_ids, sampled,
                 layout, use_torch)


# Batches a real InputBatch can hold (ids fit its int32 tensor; no torch
# sampled ids: real_input_batch makes its own tensor).
VLLM_MAX_REQS = 10
vllm_batches = batches(max_reqs=VLLM_MAX_REQS, torch_allowed=False,
                       output_items=INT32_OUTPUT_ITEMS)


def real_input_batch(batch: Batch) -> tuple[Any, dict[str, Any]]:
    """A real vLLM InputBatch holding ``batch``, and its CachedRequestStates.

    Built with ``add_request`` for every request and ``remove_request`` for
    the holes, so the request ids and the output lists (shared with each
    ``CachedRequestState`` and the sampling metadata) are vLLM's own."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM is imported
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

    input_batch = InputBatch(
        max_num_reqs=VLLM_MAX_REQS,
        max_model_len=64,
        max_num_batched_tokens=64,
        device=torch.device("cpu"),
        vocab_size=2**31 - 1,
        block_sizes=[16],
        max_num_blocks_per_req=[4],
        # Makes vLLM keep output_token_ids in its sampling metadata, as
        # penalties, bad words or a thinking budget would.
        logitsprocs_need_output_token_ids=True,
    )
    states = {}
    pairs = zip(batch.req_ids, batch.output_token_ids, strict=True)
    for index, (req_id, output) in enumerate(pairs):
        state = CachedRequestState(
            req_id=req_id if req_id is not None else f"removed-{index}",
            prompt_token_ids=[1, 2, 3],
            mm_features=[],
            sampling_params=SamplingParams(temperature=0.0),
            generator=None,
            block_ids=([],),
            num_computed_tokens=3,
            output_token_ids=list(output) if output is not None else [5],
        )
        states[state.req_id] = state
        assert input_batch.add_request(state) == index
    input_batch.refresh_metadata()
    for index, req_id in enumerate(batch.req_ids):
        if req_id is None:
            input_batch.remove_request(f"removed-{index}")  # leaves a hole
    input_batch.prev_req_id_to_index = dict(batch.prev_req_id_to_index)
    input_batch.sampled_token_ids_cpu = torch.from_numpy(batch.sampled.copy())
    input_batch.async_copy_ready_event = CountingEvent()
    return input_batch, states


def vllm_0_33_loop(req_ids, prev_req_id_to_index, output_token_ids,
                   sampled_token_ids, copy_ready) -> None:
    """The body of vLLM 0.33.0's ``InputBatch.update_async_output_token_ids``.

    Transcribed line for line (Apache-2.0, vllm/v1/worker/gpu_input_batch.py),
    with the batch's attributes as arguments, so that the suites without vLLM
    installed still check against vLLM's own algorithm and error types.  The
    ``vllm``-marked tests check the real class.
    """
    sampled_ids = None
    for index, req_id in enumerate(req_ids):
        prev_index = prev_req_id_to_index.get(req_id)
        if prev_index is None:
            continue
        req_output_token_ids = output_token_ids[index]
        if not req_output_token_ids or req_output_token_ids[-1] != -1:
            continue
        if sampled_ids is None:
            copy_ready.synchronize()
            sampled_ids = sampled_token_ids.tolist()
        new_ids = sampled_ids[prev_index]
        if not new_ids:
            continue
        num_sampled_ids = len(new_ids) if new_ids[-1] != -1 else new_ids.index(-1)
        first_placeholder = len(req_output_token_ids)
        while first_placeholder > 0 and req_output_token_ids[first_placeholder - 1] == -1:
            first_placeholder -= 1
        num_placeholders = len(req_output_token_ids) - first_placeholder
        num_to_replace = min(num_sampled_ids, num_placeholders)
        del new_ids[num_to_replace:]
        req_output_token_ids[first_placeholder:] = new_ids


def vllm_0_21_method(self) -> None:
    """vLLM 0.21.0's method (Apache-2.0), as a function of the batch: the
    placeholder start is found by a forward ``list.index(-1)``, O(output
    length) per request (vLLM PR #42938).  A baseline for the benchmarks and
    a "changed target" for the plugin's guard."""
    output_token_ids = self.sampling_metadata.output_token_ids
    if self.sampled_token_ids_cpu is None or not output_token_ids:
        return
    sampled_token_ids = None
    for index, req_id in enumerate(self.req_ids):
        prev_index = self.prev_req_id_to_index.get(req_id)
        if prev_index is None:
            continue
        req_output_token_ids = output_token_ids[index]
        if not req_output_token_ids or req_output_token_ids[-1] != -1:
            continue
        if sampled_token_ids is None:
            self.async_copy_ready_event.synchronize()
            sampled_token_ids = self.sampled_token_ids_cpu.tolist()
        new_ids = sampled_token_ids[prev_index]
        if not new_ids:
            continue
        num_sampled_ids = len(new_ids) if new_ids[-1] != -1 else new_ids.index(-1)
        first_placeholder = req_output_token_ids.index(-1)
        num_placeholders = len(req_output_token_ids) - first_placeholder
        num_to_replace = min(num_sampled_ids, num_placeholders)
        del new_ids[num_to_replace:]
        req_output_token_ids[first_placeholder:] = new_ids
